import sys

import torch

sys.path.insert(0, "build")
torch.ops.load_library("build/stable_proto.so")
P = torch.ops.proto
ts = [torch.randn(100) for _ in range(3)]
ts[1][5] = float("nan")
out = P.scan(ts)
print("scan", [o.shape for o in out], out[0][0].tolist())
try:
    P.scan(ts, True, True)
except RuntimeError as e:
    print("err type", type(e).__name__, "msg:", str(e)[:300])
try:
    P.scan([torch.zeros(3, dtype=torch.float64)])
except RuntimeError as e:
    print("err2:", str(e)[:300])
# version counter
t = torch.zeros(4)
v0 = t._version
P.raw_write_(t)
print("raw_write_ version", v0, "->", t._version, t[0].item())
ts2 = [torch.ones(3), torch.ones(3)]
vs = [x._version for x in ts2]
P.scale_(ts2, torch.tensor(2.0))
print("scale_ (aten mul_ inside) versions", vs, "->", [x._version for x in ts2], ts2[0].tolist())
# item on float32 coef
P.scale_(ts2, torch.tensor(1.0, dtype=torch.float32))
print("item float32 ok")
# Scalar arg through dispatcher
try:
    x = torch.zeros(2)
    P.add_one_scalar_(x)
    print("add_ with Scalar alpha OK", x)
except Exception as e:
    print("add_ Scalar alpha FAILS:", type(e).__name__, str(e).splitlines()[0][:300])
# is_inference / _version through dispatcher
with torch.inference_mode():
    it = torch.zeros(2)
print("is_inference(normal)", P.is_inference(torch.zeros(2)), "is_inference(inf)", P.is_inference(it))
print("version_of", P.version_of(t))
try:
    P.version_of(it)
except Exception as e:
    print("version_of(inference) raises:", str(e).splitlines()[0][:200])
# raw write on inference tensor outside inference mode: does dispatcher refuse?
try:
    P.raw_write_(it)
    print("raw_write_ on inference tensor outside InferenceMode: NOT refused")
except Exception as e:
    print("raw_write_ inference refused:", str(e)[:200])
# autograd: requires_grad input
g = torch.randn(3, requires_grad=True)
o = P.scan([g])
print("scan output requires_grad:", o[2].requires_grad, o[2].grad_fn)
with torch.no_grad():
    o = P.scan([g])
print("under no_grad:", o[2].requires_grad)
# record composite with optional None
rows = torch.zeros(3, 4)
counter = torch.tensor(5)
P.record_(rows, counter, [torch.tensor([1.0, 2.0]), torch.tensor([3, 4])], None, [])
print("record_", rows.tolist(), counter.item(), "versions", rows._version, counter._version)
