"""The closed-form side: model shapes, the byte model, skewed routing, capacity factors, buffer
sizes and memory budgets. Pure arithmetic (on sizes, or on a routing tensor); nothing here
imports :mod:`moe_kernels.kernels`, so every number of the chapter can be computed at the real
model shapes on any machine.
"""
