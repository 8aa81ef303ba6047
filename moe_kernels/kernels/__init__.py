"""The Triton kernels, each beside its torch reference, all grouped GEMMs on one tile-GEMM core.

``routing`` (gate, top-k), ``align`` (``moe_align_block_size``), the three grouped-GEMM layouts
(``index_gather``, ``permute``, ``masked``) on ``_tile_gemm``, the top-k sum (``combine``), the
shared expert (``shared``), token dropping for comparison (``dropping``), and the tile
configurations (``config``, tuned tables in ``configs/*.json``).
"""
