"""SiteSignature: what identifies an attention site and fixes the shapes of its factors.

Sites are identified by their K/V weight names, not by their position: a graph fragment after a graph
break numbers its sites from 0, and the cache layer a site writes is checked where it is rewritten.

Shared by a site matched in a graph (`passes.sites.AttentionSite.signature`) and a plan's site
(`SitePlan.signature`), so that whether a plan fits a model is one comparison (`lrkv_compile.fit`).
"""
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class SiteSignature:
    k_weight: str         # parameter names of the K and V projections
    v_weight: str
    hidden_size: int      # input features of the K/V projections
    num_kv_heads: int
    head_dim: int

    def differences(self, found: "SiteSignature") -> list[str]:
        """'field: planned X, model Y' for every field where `found` (the model's site) differs."""
        return [f"{f.name}: planned {getattr(self, f.name)!r}, model {getattr(found, f.name)!r}"
                for f in fields(self) if getattr(self, f.name) != getattr(found, f.name)]
