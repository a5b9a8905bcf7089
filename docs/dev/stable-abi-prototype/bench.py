import time

import torch

torch.ops.load_library("build/stable_proto.so")
torch.ops.load_library("build/legacy_proto.so")
torch.set_grad_enabled(False)
for n in (10, 1000, 10000):
    ts = [torch.zeros(4) for _ in range(n)]
    for name, f in (
        ("stable noop", torch.ops.proto.noop_list.default),
        ("stable raw+meta", torch.ops.proto.noop_list_raw.default),
        ("legacy noop", torch.ops.legacy.noop_list.default),
        ("stable check", torch.ops.proto.check_list.default),
        ("legacy check", torch.ops.legacy.check_list.default),
    ):
        for _ in range(20):
            f(ts)
        reps = max(20, 20000 // n)
        t0 = time.perf_counter()
        for _ in range(reps):
            f(ts)
        dt = (time.perf_counter() - t0) / reps
        print(f"n={n:6d} {name}: {dt * 1e6:9.1f} us/call  ({dt * 1e9 / n:6.1f} ns/tensor)")
    # scan with metadata queries
