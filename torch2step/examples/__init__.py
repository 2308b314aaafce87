"""A short hand-written STeP program for the documentation (:mod:`.tiled_matmul`).

The builders the lowering uses for real layers (MoE, GQA decode and prefill attention) are in
:mod:`torch2step.lower.blocks`.
"""
