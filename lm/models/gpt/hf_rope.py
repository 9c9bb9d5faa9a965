"""The rotary settings of a Hugging Face config.json read into lm's model keys: transformers 5's rope_parameters,
4.x's rope_theta and rope_scaling, and the two tables checked against each other where a file has both."""

from typing import Any

_ROPE_KEYS = {"default": ("rope_theta", "partial_rotary_factor"), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
"""The settings each rope_type reads (every type also the default's)"""
DEFAULT_THETAS = {"mixtral": 1e6, "smollm3": 2e6}
"""transformers 5's default_theta of the classes whose default is not 10000: the rope_theta of a config.json that
gives none"""


def _rope_table(hf: dict, key: str, default_theta: float, problems: list[str]) -> dict[str, Any]:
    """The rotary table `key` (rope_scaling or rope_parameters) as transformers 5 completes it: its rope_type (else
    its 4.x name, type), and rope_theta (else the class's `default_theta`), partial_rotary_factor and the original
    context from the top level where it has none. Empty for a table that is missing, null or empty."""
    table = hf.get(key) or {}
    if not table:
        return {}
    if "type" in table and "rope_type" in table and table["type"] != table["rope_type"]:
        problems.append(f"{key}.type={table['type']!r} with {key}.rope_type={table['rope_type']!r} (transformers 5 "
                        "reads rope_type, 4.x type; keep one)")
    for name in ("rope_theta", "partial_rotary_factor"):
        if name in hf and name in table and hf[name] != table[name]:
            problems.append(f"{name}={hf[name]} with {key}.{name}={table[name]} (transformers 5 reads {key}'s, 4.x "
                            "the top-level one; keep one)")
    context = "original_max_position_embeddings"
    if context in hf and context in table and hf[context] != table[context]:
        problems.append(f"{context}={hf[context]} with {key}.{context}={table[context]} (transformers 5 builds "
                        f"the rotary frequencies from the top-level one, {key}'s when there is none; keep one)")
    return {"rope_type": table.get("rope_type", table.get("type", "default")),
            "rope_theta": table.get("rope_theta", hf.get("rope_theta", default_theta)),
            "partial_rotary_factor": table.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)),
            # Phi-3's convention: transformers 5's scaled rotary embeddings take a top-level value first
            context: hf.get(context, table.get(context, hf.get("max_position_embeddings", 2048))),
            **{name: table[name] for name in ("factor", "low_freq_factor", "high_freq_factor") if name in table}}


def _rope_disagreement(scaling: dict[str, Any], parameters: dict[str, Any]) -> str | None:
    """Where the completed rope_scaling and rope_parameters tables differ in a setting their rope_type reads."""
    if scaling["rope_type"] != parameters["rope_type"]:
        return f"rope_type {scaling['rope_type']!r} against {parameters['rope_type']!r}"
    read = (*_ROPE_KEYS["default"], *_ROPE_KEYS.get(scaling["rope_type"], ()))
    differ = [f"{key} {scaling.get(key)} against {parameters.get(key)}" for key in read
              if scaling.get(key) != parameters.get(key)]
    return ", ".join(differ) or None


def rope_fields(hf: dict, problems: list[str], default_theta: float = 10000.0) -> dict[str, Any]:
    """Our rotary keys from transformers 5's rope_parameters or 4.x's rope_theta and rope_scaling: plain, linear
    or Llama 3 scaling; any other scaling, or a partial rotary factor, is a problem. Where both tables are there
    (lm's exports write both, the same) they must agree: transformers 5 takes rope_scaling whole in place of
    rope_parameters (rope_parameters' rope_theta included), 4.x reads rope_scaling alone, and a hand edit of one
    (extending the context, say) leaves the other stale; lm will not guess which was meant. A file without any
    rope_theta has its class's `default_theta` (transformers' `default_theta`: Mixtral's is 1e6)."""
    scaling = _rope_table(hf, "rope_scaling", default_theta, problems)
    parameters = _rope_table(hf, "rope_parameters", default_theta, problems)
    if scaling and parameters and (differ := _rope_disagreement(scaling, parameters)):
        problems.append(f"rope_scaling and rope_parameters disagree: {differ} (transformers applies rope_scaling; "
                        "keep one of the two keys, or make them the same)")
    origin = "rope_scaling" if scaling else "rope_parameters"
    params = scaling or parameters or {"rope_type": "default", "rope_theta": hf.get("rope_theta", default_theta),
                                       "partial_rotary_factor": hf.get("partial_rotary_factor", 1.0)}
    kind = params["rope_type"]
    fields: dict[str, Any] = {"rope_theta": float(params["rope_theta"])}
    factor = params["partial_rotary_factor"]
    if factor != 1.0:
        problems.append(f"partial_rotary_factor={factor} (lm rotates every channel of a head)")
    if kind in ("linear", "llama3"):
        needed = ["factor"] + (["low_freq_factor", "high_freq_factor"] if kind == "llama3" else [])
        if missing := [key for key in needed if key not in params]:
            problems.append(f"{origin} of rope_type {kind!r} without {', '.join(missing)}")
            return fields
        fields |= {"rope_scaling": kind, "rope_factor": float(params["factor"])}
        if kind == "llama3" and not params["low_freq_factor"] < params["high_freq_factor"]:
            problems.append(f"{origin}.low_freq_factor={params['low_freq_factor']} not below its high_freq_factor="
                            f"{params['high_freq_factor']} (Llama 3's blend between the two bands divides by their "
                            "difference)")
        elif kind == "llama3":
            # the original context: the top-level one, else the table's, else max_position_embeddings (`_rope_table`)
            fields |= {"rope_low_freq_factor": float(params["low_freq_factor"]),
                       "rope_high_freq_factor": float(params["high_freq_factor"]),
                       "rope_original_context": params["original_max_position_embeddings"]}
    elif kind != "default":
        problems.append(f"{origin}.rope_type={kind!r} (lm scales rotary positions as linear or llama3 only)")
    return fields
