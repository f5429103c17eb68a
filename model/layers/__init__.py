"""The building blocks every model family is made of (`flax.nnx` modules over pure functions):
norm.py (RMSNorm), linear.py (Linear, Embedding, grouped projections), mlp.py (the gated MLP),
rope.py (rotary embedding), attention.py (q/k/v/o around the attention backend), block.py (the
pre-norm decoder layer of the Llama lineage), decoder.py (embedding, layer stack, final norm, LM
head, and `CausalLM`, the functional face the step programs call), lora.py (the adapters'
per-row product). How each computes (dot, norm kernel, layer loop, dtype, quantization) is the
compute plan's (model/compute/plan.py), handed in; a family composes these in its own file
(model/families/)."""
