"""Structured outputs: grammars compiled off the engine thread, one matcher per request, and the
per-step token mask.

Grammar engine: xgrammar (pinned in pyproject; see docs/server.md for why). Three parts:

* :class:`GrammarCompiler` turns a :class:`~tokenmill.engine.sampling_params.StructuredOutputs`
  into a compiled grammar on its own worker thread and caches the result (a ``Future``) per
  distinct spec, so a schema is compiled once. It is thread-safe: the HTTP server uses it to
  report an invalid schema as a 400 before the request reaches the engine, and the engine uses
  it for requests added directly (offline API). A request whose grammar is still compiling is
  held by the engine outside the scheduler, so it never blocks the batch.
* :class:`GrammarState` is one request's matcher. ``fill_mask`` writes the allowed-token bitmask
  of the next position, ``accept`` advances by the sampled token. ``accept_tokens`` and
  ``rollback`` test a sequence of tokens and undo it, which is what checking speculative drafts
  against the grammar needs.
* :func:`apply_grammar_masks` is the hook the model runner calls between the forward pass and the
  sampler: rows of constrained requests get disallowed tokens set to ``-inf``. With speculative
  drafts a request has ``k + 1`` rows, and row ``j`` gets the mask of the grammar advanced through
  the first ``j`` drafts (:func:`fill_draft_masks`: advance, fill, then roll back), so verification
  sees exactly the distributions the plain sampler would see one token at a time.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.contracts.sampling import StructuredOutputs

if TYPE_CHECKING:
    from tokenmill.engine.request import Request

log = logging.getLogger(__name__)

# JSON text generated under a schema or json_object: compact separators, and at most this many
# whitespace characters wherever the grammar allows whitespace (keeps small models from
# spending their token budget on newlines).
_MAX_WHITESPACE = 2


class GrammarError(ValueError):
    """The constraint is not valid (bad schema, regex or grammar); the message names the problem."""


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer (thread-safe).

    ``compile(spec)`` returns a ``Future`` that resolves to an opaque compiled grammar or fails
    with :class:`GrammarError`. At most ``max_cached`` specs are kept (least recently used go).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], *,
                 max_cached: int = 512) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                         stop_token_ids=list(eos_token_ids))
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutputs, Future[Any]] = OrderedDict()
        self.max_cached = max_cached
        self.num_compiled = 0

    def compile(self, spec: StructuredOutputs) -> Future[Any]:
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec] = fut
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return fut

    def compile_now(self, spec: StructuredOutputs) -> Any:
        """Compile (or take from the cache) and wait; raises :class:`GrammarError`."""
        return self.compile(spec).result()

    def _compile(self, spec: StructuredOutputs) -> Any:
        c = self._compiler
        try:
            if spec.kind == "json_schema":
                json.loads(spec.spec)  # a clear message for text that is not JSON at all
                grammar = c.compile_json_schema(spec.spec, any_whitespace=False, strict_mode=True)
            elif spec.kind == "json_object":
                grammar = c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            elif spec.kind == "regex":
                grammar = c.compile_regex(spec.spec)
            elif spec.kind == "choice":
                options = json.loads(spec.spec)
                if not options or not all(isinstance(o, str) and o for o in options):
                    raise GrammarError("choice must be a non-empty list of non-empty strings")
                ebnf = "root ::= " + " | ".join(_ebnf_literal(o) for o in options)
                grammar = c.compile_grammar(ebnf)
            elif spec.kind == "grammar":
                grammar = c.compile_grammar(spec.spec)
            else:  # structural_tag
                grammar = c.compile_structural_tag(spec.spec)
        except GrammarError:
            raise
        except json.JSONDecodeError as e:
            raise GrammarError(f"{spec.kind} is not valid JSON: {e}") from None
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with its reason
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise GrammarError(f"invalid {spec.kind}: {msg}") from None
        self.num_compiled += 1
        return grammar

    def matcher(self, compiled: Any) -> GrammarState:
        return GrammarState(self._xgr.GrammarMatcher(compiled), self.vocab_size)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _ebnf_literal(text: str) -> str:
    out = ['"']
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


class GrammarState:
    """One request's position in its grammar.

    ``fill_mask(bitmask, row)`` writes the tokens allowed next into row ``row`` of an xgrammar
    bitmask; ``accept(token)`` advances (False: the token is not allowed, the state is unchanged).
    For speculative drafts: ``accept_tokens(tokens)`` advances over as many leading tokens as the
    grammar allows and returns that count; ``rollback(n)`` undoes the last ``n`` accepted tokens.
    """

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self.num_accepted = 0

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        if self._m.accept_token(int(token_id)):
            self.num_accepted += 1
            return True
        return False

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        n = 0
        for t in token_ids:
            if not self.accept(t):
                break
            n += 1
        return n

    def draft_prefix(self, token_ids: Sequence[int], *, keep_rejected: bool = False) -> int:
        """How many leading drafts of ``token_ids`` to verify: those the grammar allows from
        here, stopping after one that terminates it (nothing may follow a stop token). The state
        is unchanged.

        ``keep_rejected``: also keep the first draft the grammar rejects. Drafts that come with
        a distribution ``q`` need it: their masked row gives it probability 0, so verification
        rejects it and draws from the residual ``max(0, p - q)``, which is what keeps the
        output distributed as ``p``; cutting it would draw from ``p`` instead and bias the
        output towards the tokens ``q`` favours. (A point-mass draft loses nothing by the cut:
        both ways the row's token is drawn from ``p``.)"""
        n = 0
        rejected = False
        for t in token_ids:
            if self.is_terminated:
                break
            if not self.accept(t):
                rejected = True
                break
            n += 1
        self.rollback(n)
        return n + 1 if rejected and keep_rejected else n

    def fill_draft_masks(self, drafts: Sequence[int], bitmask: torch.Tensor, row: int) -> None:
        """Rows ``row .. row + len(drafts)`` of ``bitmask``: see :func:`fill_draft_masks`."""
        fill_draft_masks(self, drafts, bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens, {self.num_accepted} were accepted")
        if num_tokens:
            self._m.rollback(num_tokens)
            self.num_accepted -= num_tokens

    @property
    def is_terminated(self) -> bool:
        """The grammar has accepted its end (a stop token): nothing more may follow."""
        return bool(self._m.is_terminated())


def apply_grammar_masks(logits: torch.Tensor, requests: Sequence[Request],
                        drafts: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """Mask, in place, the rows of ``logits`` of requests that carry a grammar: tokens the
    grammar does not allow next become ``-inf``.

    Without ``drafts`` row ``i`` is ``requests[i]``. With ``drafts`` (speculative verification)
    request ``i`` owns ``1 + len(drafts[i])`` consecutive rows, and row ``j`` of them is masked
    with the grammar advanced through ``drafts[i][:j]`` (see :func:`fill_draft_masks`)."""
    counts = [1] * len(requests) if drafts is None else [1 + len(d) for d in drafts]
    starts: list[int] = []
    n = 0
    for c in counts:
        starts.append(n)
        n += c
    if n != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits for {n} rows of {len(requests)} requests")
    constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not constrained:
        return logits
    import xgrammar as xgr

    rows = [starts[i] + j for i in constrained for j in range(counts[i])]
    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])   # all allowed
    at = 0
    for i in constrained:
        g = requests[i].grammar
        if counts[i] == 1:
            g.fill_mask(bitmask, at)
        else:
            g.fill_draft_masks(drafts[i], bitmask, at)   # type: ignore[index]
        at += counts[i]
    if len(rows) == logits.shape[0]:
        xgr.apply_token_bitmask_inplace(logits, bitmask)
    else:
        sub = logits[rows]
        xgr.apply_token_bitmask_inplace(sub, bitmask)
        logits[rows] = sub
    return logits


def fill_draft_masks(state: GrammarState, drafts: Sequence[int], bitmask: torch.Tensor, row: int) -> None:
    """Rows ``row .. row + len(drafts)`` of ``bitmask``: the tokens allowed before each draft
    and after the last one, i.e. row ``row + j`` is the mask of ``state`` advanced through
    ``drafts[:j]``. The state is walked forward and rolled back, so it is unchanged afterwards.

    Drafts are checked against the grammar when they are proposed (:meth:`GrammarState.draft_prefix`),
    so each one is accepted here; should one not be, the rows after it are left all-allowed: its
    own row forbids it, so verification rejects it (or an earlier draft) and never reads them.
    Rows after a draft that terminates the grammar (a stop token) stay all-allowed too: the
    request ends at that token."""
    walked = 0
    for j in range(len(drafts) + 1):
        if state.is_terminated:
            break
        state.fill_mask(bitmask, row + j)
        if j == len(drafts) or not state.accept(drafts[j]):
            break
        walked += 1
    state.rollback(walked)


class GrammarWaitRoom:
    """Constrained requests whose grammar is still compiling, held outside the scheduler.

    The engine adds a request here instead of queueing it when its grammar's ``Future`` is not
    done, and each step moves the ready ones to the scheduler (:meth:`pop_done`), so the batch
    never waits for a compile.
    """

    def __init__(self) -> None:
        self._items: dict[str, tuple[Request, Future[Any]]] = {}

    def add(self, req: Request, future: Future[Any]) -> None:
        self._items[req.request_id] = (req, future)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._items

    def __len__(self) -> int:
        return len(self._items)

    def remove(self, request_id: str) -> Request | None:
        item = self._items.pop(request_id, None)
        return item[0] if item is not None else None

    def pop_done(self, compiler: GrammarCompiler) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose compile finished: (ready, with ``grammar`` set; failed, with the error)."""
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        for rid, (req, fut) in list(self._items.items()):
            if not fut.done():
                continue
            del self._items[rid]
            exc = fut.exception()
            if exc is not None:
                failed.append((req, str(exc)))
            else:
                req.grammar = compiler.matcher(fut.result())
                ready.append(req)
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until one compile finishes or ``timeout`` passes (the engine has nothing else to do)."""
        from concurrent.futures import FIRST_COMPLETED
        from concurrent.futures import wait as wait_futures

        if self._items:
            wait_futures([f for _, f in self._items.values()], timeout=timeout, return_when=FIRST_COMPLETED)
