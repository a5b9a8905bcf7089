"""nanscan: the numeric health of every gradient in one fused pass.

report = nanscan.check(model, max_norm=1.0)   # scan + clip, no host sync
if not report.finite:
    print(report.nonfinite)                    # names of the parameters that went bad
"""

from . import amp, ddp, layouts, records, replicas, sinks
from .activations import ActivationWatch, ModuleActivations, watch_activations
from .check import check
from .clip import clip_grad_norm_, get_total_norm
from .fused import SUPPORTED_DTYPES, ScanResult
from .guard import NonFiniteGradientError, SkipGuard
from .locate import Finding, Locator, locate
from .recorder import Recorder
from .replicas import ReplicaCheck, verify_replicas
from .report import Report
from .scan import scan
from .state import check_state
from .updates import UpdateWatch, watch_updates

__all__ = [
    "SUPPORTED_DTYPES",
    "ActivationWatch",
    "Finding",
    "Locator",
    "ModuleActivations",
    "NonFiniteGradientError",
    "Recorder",
    "ReplicaCheck",
    "Report",
    "ScanResult",
    "SkipGuard",
    "UpdateWatch",
    "amp",
    "check",
    "check_state",
    "clip_grad_norm_",
    "ddp",
    "get_total_norm",
    "layouts",
    "locate",
    "records",
    "replicas",
    "scan",
    "sinks",
    "verify_replicas",
    "watch_activations",
    "watch_updates",
]
__version__ = "0.1.0"
