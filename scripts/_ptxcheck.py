import torch
from engine import kernels
x = torch.randn(128, 768, device="cuda", dtype=torch.half)
w = torch.randn(768, 768, device="cuda", dtype=torch.half)
out = torch.empty(2, 128, 768, device="cuda")
k = kernels._linear_kernel[(2, 24, 2)](
    x, w, w, out, 128, 768, 768, 384, BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, ACT=0,
    SPLIT=2, num_warps=4, num_stages=3, GDC=True, launch_pdl=True,
    **kernels._ahead(w, 96, True))
ptx = k.asm["ptx"]
print("ahead", kernels._ahead(w, 96, True))
print("prefetch in ptx:", ptx.count("cp.async.bulk.prefetch"), "griddepcontrol:", ptx.count("griddepcontrol"))
ref = (x.float() @ w.float().t())
print("partials sum vs ref max diff", (out.sum(0) - ref).abs().max().item())
