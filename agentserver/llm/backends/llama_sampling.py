"""Grammar-constrained sampling for the local backend: sample first, check the grammar after.

llama-cpp-python's ``Llama.generate(grammar=...)`` puts the grammar first in its sampler
chain, so at every step the grammar is matched against the whole vocabulary (49,152
tokens for SmolLM2) before one token is chosen. Most steps the model's own choice is one
the grammar allows anyway. So, as llama.cpp's own ``common_sampler`` does: sample from the
plain chain, check that one token against the grammar (a one-candidate array), and only
when the grammar refuses it, apply the grammar to the whole vocabulary and sample again.
Greedy, the tokens are the ones the grammar-first chain chooses (the best the grammar
allows; tests/test_local_model.py checks it). With a temperature every token is still one
the grammar allows, but the draw differs a little from grammar-first's: an allowed token
the model itself drew is kept, so the plain distribution decides more often, exactly as
in llama.cpp's own sampler.

Thread side only (the backend's worker thread owns the model while this runs). Public
llama-cpp-python API only: ``Llama.eval``/``reset``/``ctx``/``model``/``n_vocab`` and the
``llama_cpp.llama_sampler_*`` bindings.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..local_models import import_llama_cpp

__all__ = ["GrammarRefused", "constrained_tokens"]

#: llama.cpp's sampler defaults (``Llama.generate``'s), for a temperature above 0.
_TOP_K, _TOP_P, _MIN_P = 40, 0.95, 0.05


class GrammarRefused(RuntimeError):
    """The grammar allows no token at all here: a grammar that cannot end (a bug in the
    XSD translation), never the model's fault. Raised instead of accepting a refused token,
    which llama.cpp would abort the process on."""


def _plain_chain(llama_cpp: Any, temperature: float, seed: int) -> Any:
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    if temperature <= 0:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
        return chain
    for sampler in (
        llama_cpp.llama_sampler_init_top_k(_TOP_K),
        llama_cpp.llama_sampler_init_top_p(_TOP_P, 1),
        llama_cpp.llama_sampler_init_min_p(_MIN_P, 1),
        llama_cpp.llama_sampler_init_temp(temperature),
        llama_cpp.llama_sampler_init_dist(seed),
    ):
        llama_cpp.llama_sampler_chain_add(chain, sampler)
    return chain


def constrained_tokens(
    llama: Any, prompt: list[int], grammar: str, temperature: float, seed: int = 0
) -> Iterator[int]:
    """The tokens ``llama`` samples after ``prompt`` under the GBNF ``grammar`` (root rule
    ``root``), one at a time, without end: the caller stops at an end-of-generation token
    (allowed only where the grammar may end) or at its budget. The model's state is reset
    first. Raises ``ValueError`` for a grammar llama.cpp cannot parse and
    :class:`GrammarRefused` if no token is allowed."""
    llama_cpp = import_llama_cpp()
    vocab = llama_cpp.llama_model_get_vocab(llama.model)
    checker = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
    if not checker:
        raise ValueError("llama.cpp could not parse the reply grammar")
    chain = _plain_chain(llama_cpp, temperature, seed)
    n_vocab = llama.n_vocab()
    one = (llama_cpp.llama_token_data * 1)()
    one_ptr = ctypes.cast(one, ctypes.POINTER(llama_cpp.llama_token_data))
    one_array = llama_cpp.llama_token_data_array(one_ptr, 1, -1, False)
    # The whole vocabulary, for the steps where the model's choice is refused; laid out
    # as llama_token_data (id, logit, p) so llama.cpp reads it in place.
    every = np.zeros(
        n_vocab,
        dtype=np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True),
    )
    every_ids = np.arange(n_vocab, dtype=np.intc)
    try:
        _eval_prompt(llama_cpp, llama, prompt)
        while True:
            token = llama_cpp.llama_sampler_sample(chain, llama.ctx, -1)
            one[0].id, one[0].logit, one[0].p = token, 0.0, 0.0
            one_array.data, one_array.selected, one_array.size = one_ptr, -1, 1
            llama_cpp.llama_sampler_apply(checker, ctypes.byref(one_array))
            if math.isinf(one[0].logit):
                token = _resample(llama_cpp, llama, checker, chain, every, every_ids, n_vocab)
                llama_cpp.llama_sampler_accept(chain, token)
            llama_cpp.llama_sampler_accept(checker, token)
            yield token
            llama.eval([token])
    finally:
        llama_cpp.llama_sampler_free(chain)
        llama_cpp.llama_sampler_free(checker)


def _eval_prompt(llama_cpp: Any, llama: Any, prompt: list[int]) -> None:
    """Evaluate ``prompt``, reusing the model's cache for the prefix it shares with what was
    evaluated last (an agent's next step repeats its whole conversation): as
    ``Llama.generate`` does. At least one token is evaluated, so the logits are this
    prompt's. ``Llama.eval`` drops the cache past ``n_tokens`` itself."""
    keep = 0
    if not (
        llama_cpp.llama_model_is_recurrent(llama.model)
        or llama_cpp.llama_model_is_hybrid(llama.model)
    ):
        done = llama.input_ids[: llama.n_tokens]
        limit = min(len(done), len(prompt) - 1)
        while keep < limit and done[keep] == prompt[keep]:
            keep += 1
    if keep == 0:
        llama.reset()
    else:
        llama.n_tokens = keep
    llama.eval(prompt[keep:])


def _resample(
    llama_cpp: Any,
    llama: Any,
    checker: Any,
    chain: Any,
    every: np.ndarray,
    every_ids: np.ndarray,
    n_vocab: int,
) -> int:
    """The grammar over the whole vocabulary, then the plain chain on what it allows."""
    logits = llama_cpp.llama_get_logits_ith(llama.ctx, -1)
    every["id"] = every_ids
    every["logit"] = np.ctypeslib.as_array(logits, shape=(n_vocab,))
    every["p"] = 0.0
    data = every.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data))
    array = llama_cpp.llama_token_data_array(data, n_vocab, -1, False)
    llama_cpp.llama_sampler_apply(checker, ctypes.byref(array))
    llama_cpp.llama_sampler_apply(chain, ctypes.byref(array))
    if not 0 <= array.selected < array.size:
        raise GrammarRefused("the reply grammar allows no token here")
    chosen = every[array.selected]
    if math.isinf(float(chosen["logit"])) and float(chosen["logit"]) < 0:
        raise GrammarRefused("the reply grammar allows no token here")
    return int(chosen["id"])
