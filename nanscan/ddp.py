"""``nanscan.ddp``: the public name of DDP's bucket-scanning hook (nanscan.layouts.ddp), which names
the rank whose own gradient made a NaN before DDP's all-reduce spreads it to every rank."""

from .layouts.ddp import BucketScanner, attach

__all__ = ["BucketScanner", "attach"]
