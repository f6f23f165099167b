"""The GEMM engine of issue 48 (being probed): a warp-specialised, persistent, TMA-fed Gluon GEMM for Hopper, dense
and grouped over experts.

    gluon_gemm.py   C = A · B in bf16 with fp32 accumulation: a TMA loading warp, an mbarrier ring, one or two
                    wgmma consumer partitions (cooperative or ping-pong), a grouped persistent tile order
    grouped_gemm.py C[r] = A[r] · B_e over experts with varlen rows (sorted by expert, ``offsets`` on the device):
                    the same machinery, a tile schedule walked on the device, the MoE layer's epilogues (row
                    scale; SwiGLU writing a, g, u as asked; the backward's dSwiGLU with the routing weight's row
                    sums) and its weights as pairs (gate and up; two weights along K), bf16 or fp32 out
    grouped_tl.py   the grouped GEMM in plain Triton (the same schedule and epilogues), for the interpreter and
                    for reading
    grouped_wgrad.py  C_p[e] = A_p[rows_e]ᵀ · B_p[rows_e]: the varlen-K form for weight gradients (1 to 3 products
                    a launch, an arithmetic schedule, the ragged K end zero-filled by descriptors made on the device)
    grouped_wgrad_tl.py  the same in plain Triton, for the interpreter and for reading
    gathered.py     an operand read through a row index (the routed rows of x and dy), gathered in the loads

``scripts/p2/gemm_probe.py`` checks and times it against ``torch.mm`` at P1's and P2's dense shapes; its numbers
and the choice between this engine and QuACK's are in ``notes/p2/engine-probe.md``; ``scripts/p2/grouped_probe.py``
times the grouped form against ``torch._grouped_mm`` (``notes/p2/engine-grouped.md``), ``scripts/p2/wgrad_probe.py``
the varlen-K form (``notes/p2/engine-wgrad.md``).
"""
