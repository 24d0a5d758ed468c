# shellcheck shell=bash
# The model family of a one-shot check (sourced by scripts/rehearsal.sh and scripts/gpu_check.sh):
#   family_arg SCRIPT [ARG...]   sets FAMILY from --family F (or --family=F), else MODEL_FAMILY
#                                (run.sh's setting), else cosyvoice2; a family ttsrl does not know
#                                (ttsrl/families/) or any other argument: exit 2
family_arg() {
  local me=$1
  shift
  FAMILY=${MODEL_FAMILY:-cosyvoice2}
  while (( $# )); do
    case $1 in
      --family) FAMILY=${2:?--family needs cosyvoice2 or cosyvoice3}; shift 2 ;;
      --family=*) FAMILY=${1#--family=}; shift ;;
      *) echo "$me: unknown argument $1 (--family cosyvoice2|cosyvoice3)" >&2; exit 2 ;;
    esac
  done
  case $FAMILY in
    cosyvoice2 | cosyvoice3) ;;
    *) echo "$me: family $FAMILY: expected cosyvoice2 or cosyvoice3 (ttsrl/families/)" >&2; exit 2 ;;
  esac
}
