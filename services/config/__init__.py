"""Service configuration: one frozen dataclass per service, composed by inheritance from groups of fields
(flags.py says how a field becomes a flag and a DDTREE_* variable, and how it is checked).

    service.py      SecurityConfig, ServiceConfig: what every service has
    kv.py           the verifier's KV cache           speculation.py   the verifier's trees and drafter
    static_step.py  static shapes / CUDA graphs       cpu_runtime.py   CPU threads and weight layout
    device.py       device and dtype names
    verifier.py, drafter.py, gateway.py: the three services' configs
"""

from .cpu_runtime import DEFAULT_OMP_SPIN_COUNT
from .device import DTYPE_NAMES
from .drafter import CPU_WINDOW, CUDA_WINDOW, DrafterConfig
from .flags import ENV_PREFIX, AutoOnOff, ConfigBase, add_config_flags, config_from_flags, env_var_name, env_var_names
from .gateway import GatewayConfig
from .kv import kv_setting
from .service import DEFAULT_CHECKPOINT_DIR, SecurityConfig, ServiceConfig
from .verifier import VerifierConfig

__all__ = [
    "CPU_WINDOW",
    "CUDA_WINDOW",
    "DEFAULT_CHECKPOINT_DIR",
    "DEFAULT_OMP_SPIN_COUNT",
    "DTYPE_NAMES",
    "ENV_PREFIX",
    "AutoOnOff",
    "ConfigBase",
    "DrafterConfig",
    "GatewayConfig",
    "SecurityConfig",
    "ServiceConfig",
    "VerifierConfig",
    "add_config_flags",
    "config_from_flags",
    "env_var_name",
    "env_var_names",
    "kv_setting",
]
