"""The module verl imports (``VERL_USE_EXTERNAL_MODULES=ttsrl.verl_plugin.plugin``):
importing it installs the plugin (see ``ttsrl.verl_plugin``). Nothing else imports it."""

from ttsrl.verl_plugin import install

install()
