"""The paper's figures, printed beside ours (the figures the seed paper reports).

"Pre-Compiled Pipeline Shards for Distributed LLM Inference on Intel AI PC Fleets" (arXiv
2608.19147): Llama 3.1 8B INT4 on Intel Arc B390 iGPUs, 2 nodes over Wi-Fi 6, draft Llama 3.2
1B INT4 on the coordinator, star topology (the coordinator sends every stage its input and gets
its output back).
"""

from __future__ import annotations

SOURCE = (
    "Paper: arXiv 2608.19147, Llama 3.1 8B INT4 on Arc B390 iGPUs, 2 nodes over Wi-Fi 6, "
    "draft Llama 3.2 1B INT4, star topology"
)

# Experiment 1, single-stream decode tok/s (1-stage figures on one iGPU; "over the network" is
# the 2-node pipeline of the headline table).
PARITY_TOK_S = {"genai": 24.54, "s1": 24.45, "s1-nobeam": 21.26, "ring": 16.33}

# Headline table: tok/s (the ratio is to the monolithic single user).
MONOLITHIC = 24.54
HEADLINE = {"1 user": 16.33, "2 users": 29.34, "2 users + speculative K=3": 43.97}

# Experiment 3: single node K=3 over 8 prompts; K sweep at 100 ms per hop.
SPEC_K3_MEAN, SPEC_K3_MIN, SPEC_K3_MAX = 1.33, 1.11, 1.50
SPEC_K3_2048 = 1.58
SPEC_BEST_K_100MS, SPEC_BEST_100MS = 10, 4.07

# Experiment 4: simulated WAN, added ms per hop -> (naive single stream, 2 users + speculative),
# aggregate tok/s.
WAN = {0.0: (14.5, 41.0), 10.0: (9.9, 37.4), 50.0: (4.7, 18.3), 100.0: (2.8, 11.2)}
