"""GLOT: graph pooling of a frozen encoder's token states (Mantri et al., "GLOT"; reference code:
github ipsitmantri/GLOT, ``main.py``, whose defaults this follows: a threshold graph at 0.3, two
GAT layers of 128 units, jumping-knowledge concatenation, an attentive readout).

For each text, over its tokens only (padding is never a node):

1. **Latent token-similarity graph.** ``A_ij = 1`` when ``cos(h_i, h_j) > tau`` (``tau = 0.3``),
   a binary, undirected graph; every token keeps its self-loop (``cos(h_i, h_i) = 1``).
2. **Token refinement by a small GNN.** ``gnn_layers`` graph-attention layers (GAT, Velickovic et
   al., one head, as PyG's ``GATConv`` computes it): ``z = h W``; for an edge ``j -> i`` the logit
   ``LeakyReLU_0.2(a_src . z_j + a_dst . z_i + c)``, softmax over ``i``'s neighbours ``j``,
   ``h'_i = ReLU(sum_j alpha_ij z_j + b)``. The binary edge weight is GLOT's edge feature; through
   ``GATConv``'s edge projection a constant feature adds one learned number ``c`` per layer to every
   logit, which is how it enters here.
3. **Readout.** Jumping knowledge concatenates the input and every layer's output,
   ``H_i = [h_i ; h'_i ; h''_i]`` (``D + gnn_layers * hidden``), an MLP scores each token,
   ``s_i = w2^T tanh(W1 H_i + b1) + b2`` (``W1``: ``max(128, width // 2)`` units), and the text's
   vector is ``sum_i softmax(s)_i H_i``.

The graph is dense per text (at most one encoder window of tokens), so the GNN runs as masked
``[B, T, T]`` attention in plain torch rather than through torch-geometric's sparse message
passing: the same numbers (``tests/poolers/test_research_poolers.py`` checks them against the
equations above written per text, edge by edge), no extra dependency, and batched matmuls instead
of scatter operations on a CPU.

**Projection and untrained behaviour.** GLOT's readout vector is ``D + gnn_layers * hidden`` wide;
the paper feeds it to a task head (an optional linear projection). Here one linear layer
(``value_projection``, the default) maps it to the model's ``D``, initialised as ``[I | 0]``:
it selects the input block ``h``. The readout's last layer starts at zero, so every token weighs
the same and that block is the token mean: **untrained, ``glot`` is ``mean``** (any GNN weights),
and training starts there (the GNN's gradients arrive once the projection's zero block moves).
Without the projection (``--no-value-projection``) the head gives the readout vector itself.

The head saves, loads, binds to its encoder and splits by role as :mod:`poolers.attention`'s
(``head.json`` + ``head.safetensors``, ``kind: glot``); ``embedpool train-pooler --pooler glot``
trains it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from embedpool.errors import InvalidError
from embedpool.poolers.attention import AttentionPooler, HeadModule, head_class, role_heads
from embedpool.poolers.base import masked_mean, register
from embedpool.poolers.states import TokenStates


class DenseGATLayer(nn.Module):
    """One single-head GAT layer on a dense adjacency ``[B, T, T]`` (``adj[b, i, j]``: edge ``j -> i``)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out, bias=False)
        self.att_src = nn.Parameter(torch.empty(d_out))
        self.att_dst = nn.Parameter(torch.empty(d_out))
        self.edge = nn.Parameter(torch.zeros(()))  # c: the constant binary edge feature's logit term
        self.bias = nn.Parameter(torch.zeros(d_out))
        nn.init.xavier_uniform_(self.lin.weight)
        bound = (6.0 / (1 + d_out)) ** 0.5  # glorot on a [1, d_out] vector, as GATConv initialises it
        nn.init.uniform_(self.att_src, -bound, bound)
        nn.init.uniform_(self.att_dst, -bound, bound)

    def forward(self, h: Tensor, adj: Tensor) -> Tensor:
        z = self.lin(h)  # [B,T,H]
        logits = (z @ self.att_dst)[:, :, None] + (z @ self.att_src)[:, None, :] + self.edge  # [B,i,j]
        logits = F.leaky_relu(logits, 0.2).masked_fill(~adj, float("-inf"))
        alpha = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a padding row has no neighbours
        return alpha @ z + self.bias


@head_class
class GlotHead(HeadModule):
    """Token-similarity graph, GAT refinement, attentive readout (see the module docstring).

    Args:
        dim: token state size ``D``.
        queries: must be 1.
        value_projection: map the readout vector to ``D`` values (initialised to select the token
            mean); without it the head gives the ``D + gnn_layers * hidden`` readout vector.
        heads: must be 1.
        hidden: units of every GAT layer.
        gnn_layers: GAT layers.
        tau: cosine similarity above which two tokens are joined.
        encoder: the model the head is trained on (recorded in its config).
        meta: provenance kept in the config.
    """

    kind = "glot"
    config_keys = (*HeadModule.config_keys, "hidden", "gnn_layers", "tau", "kind")

    def __init__(self, dim: int, queries: int = 1, value_projection: bool = True, heads: int = 1,
                 encoder: str | None = None, meta: dict[str, Any] | None = None, hidden: int = 128,
                 gnn_layers: int = 2, tau: float = 0.3) -> None:
        if queries != 1 or heads != 1:
            raise InvalidError(f"glot gives one vector per text: queries and heads must be 1, got {queries} and {heads}",
                               param="pooler")
        if hidden < 1 or gnn_layers < 0 or not -1.0 <= tau <= 1.0:
            raise InvalidError(f"glot needs hidden >= 1, gnn_layers >= 0 and -1 <= tau <= 1; got {hidden}, "
                               f"{gnn_layers}, {tau}", param="pooler")
        super().__init__(dim, queries, value_projection, heads, encoder, meta)
        self.hidden, self.gnn_layers, self.tau = hidden, gnn_layers, float(tau)
        self.convs = nn.ModuleList(DenseGATLayer(dim if i == 0 else hidden, hidden) for i in range(gnn_layers))
        width = dim + gnn_layers * hidden
        self.readout = nn.Sequential(nn.Linear(width, max(128, width // 2)), nn.Tanh(),
                                     nn.Linear(max(128, width // 2), 1))
        nn.init.zeros_(self.readout[2].weight)  # every token weighs the same until trained
        nn.init.zeros_(self.readout[2].bias)
        self.value = None
        if value_projection:
            self.value = nn.Linear(width, dim)
            with torch.no_grad():
                self.value.weight.copy_(torch.eye(dim, width))  # [I | 0]: the input block
                self.value.bias.zero_()

    def graph(self, hidden: Tensor, mask: Tensor) -> Tensor:
        """The token graph ``[B, T, T]`` (bool): cosine above ``tau`` between two of a text's
        tokens, and every token's self-loop; nothing touches padding."""
        unit = F.normalize(hidden, dim=-1, eps=1e-8)
        valid = mask.bool()
        pair = valid[:, :, None] & valid[:, None, :]
        eye = torch.eye(hidden.shape[1], dtype=torch.bool)[None]
        return pair & ((unit @ unit.transpose(1, 2) > self.tau) | eye)

    def refine(self, hidden: Tensor, mask: Tensor) -> Tensor:
        """The jumping-knowledge token features ``[h ; h' ; ...]``, ``[B, T, D + gnn_layers * hidden]``."""
        adj = self.graph(hidden, mask)
        feats, h = [hidden], hidden
        for conv in self.convs:
            h = F.relu(conv(h, adj))
            feats.append(h)
        return torch.cat(feats, dim=-1)

    def forward(self, hidden: Tensor, mask: Tensor, role: str | None = None) -> Tensor:
        """``hidden [B,T,D]``, ``mask [B,T]`` -> ``[B, 1, D]`` (the readout width without the projection)."""
        feats = self.refine(hidden, mask)
        scores = self.readout(feats).squeeze(-1).masked_fill(~mask.bool(), float("-inf"))
        # exp(s - max) is exactly 1.0 for constant scores: untrained, the readout is the token mean
        weights = torch.exp(scores - scores.amax(dim=1, keepdim=True)).nan_to_num(0.0)
        pooled = masked_mean(feats, weights)
        return (pooled if self.value is None else self.value(pooled)).unsqueeze(1)


GlotRoleHeads = role_heads(GlotHead)


@register
class GlotPooler(AttentionPooler):
    """GLOT graph pooling: token-similarity graph, GAT, attentive readout.

    Args:
        weights: folder (or file) of a trained ``glot`` head; empty for the untrained head (= ``mean``).
    """

    name = "glot"
    options = {"weights": str}

    def new_head(self, states: TokenStates) -> GlotHead:
        return GlotHead(states.hidden.shape[-1])

    def output_dim(self, model_dim: int) -> int | None:
        if self.head is None or self.head.value_projection:
            return None
        return model_dim + self.head_config["gnn_layers"] * self.head_config["hidden"]
