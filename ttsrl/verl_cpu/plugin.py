"""The module verl imports (``VERL_USE_EXTERNAL_MODULES=ttsrl.verl_cpu.plugin``):
importing it installs the plugin (see ``ttsrl.verl_cpu``). Nothing else imports it."""

from . import install

install()
