"""The GEMM engine of issue 48 (being probed): one warp-specialised, persistent, TMA-fed Gluon GEMM for Hopper.

    gluon_gemm.py   C = A · B in bf16 with fp32 accumulation: a TMA loading warp, an mbarrier ring, one or two
                    wgmma consumer partitions (cooperative or ping-pong), a grouped persistent tile order

``scripts/p2/gemm_probe.py`` checks and times it against ``torch.mm`` at P1's and P2's dense shapes; its numbers
and the choice between this engine and QuACK's are in ``notes/p2/engine-probe.md``.
"""
