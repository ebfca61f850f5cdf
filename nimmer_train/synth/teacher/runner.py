"""Run generation requests through the cache and a teacher, with the teacher's concurrency."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from nimmer_train.synth.teacher.base import Teacher, TeacherReply, TeacherUnavailable, transport_failed
from nimmer_train.synth.teacher.cache import ResponseCache
from nimmer_train.voice.composition import GenerationRequest

log = logging.getLogger(__name__)


def run_requests(
    requests: list[GenerationRequest],
    teacher: Teacher,
    cache: ResponseCache,
    max_failure_share: float = 1.0,
) -> Iterator[tuple[GenerationRequest, TeacherReply, bool]]:
    """Yield (request, reply, from_cache) for every request, in completion order.

    Cached replies come first and cost nothing. Each fresh reply that arrived is written to the
    cache before it is yielded; failures (timeouts, exhausted retries) are yielded but not cached.
    At most ``teacher.concurrency`` batches are in flight. Once more than ``max_failure_share``
    of the requests have failed at the transport level, :class:`TeacherUnavailable` stops the run
    (what arrived stays cached, so the next run continues from there).
    """
    allowed = int(max_failure_share * len(requests))
    failures: Counter[str] = Counter()
    arrived = 0
    pending = []
    cached_as = teacher.model + getattr(teacher, "variant", "")  # + settings that change a reply
    for request in requests:
        hit = cache.get(teacher.backend, cached_as, request.key)
        if hit is not None:
            yield request, hit, True
        else:
            pending.append(request)
    if not pending:
        return
    log.info(
        "%d of %d requests cached; asking %s (%s) for %d",
        len(requests) - len(pending),
        len(requests),
        teacher.backend,
        teacher.model,
        len(pending),
    )
    batches = [pending[i : i + teacher.batch_size] for i in range(0, len(pending), teacher.batch_size)]
    with ThreadPoolExecutor(max_workers=teacher.concurrency) as pool:
        queue = iter(batches)
        running: dict[Future[list[TeacherReply]], list[GenerationRequest]] = {}
        try:
            for batch in queue:
                running[pool.submit(teacher.generate, batch)] = batch
                if len(running) >= teacher.concurrency:
                    break
            while running:
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    batch = running.pop(future)
                    for request, reply in zip(batch, future.result(), strict=True):
                        if reply.error is None:
                            cache.put(teacher.backend, cached_as, request.key, reply)
                            arrived += 1
                        elif transport_failed(reply):
                            failures[reply.error] += 1
                            if failures.total() > allowed:
                                raise TeacherUnavailable(
                                    _unavailable(teacher, cache, failures, arrived, allowed)
                                )
                        yield request, reply, False
                    nxt = next(queue, None)
                    if nxt is not None:
                        running[pool.submit(teacher.generate, nxt)] = nxt
        finally:
            for future in running:
                future.cancel()


def _unavailable(
    teacher: Teacher, cache: ResponseCache, failures: Counter[str], arrived: int, allowed: int
) -> str:
    where = getattr(teacher, "url", None) or getattr(teacher, "base_url", None) or teacher.model
    kinds = ", ".join(f"{kind} {n}" for kind, n in failures.most_common())
    return (
        f"teacher {teacher.backend} ({where}) is failing: {failures.total()} requests got no reply "
        f"({kinds}), more than teacher.max_failure_share allows ({allowed}). Nothing was published; "
        f"the {arrived} new replies that arrived are cached in {cache.path}. Check that the backend is "
        "reachable (teacher.base_url, the API key) and re-run: cached replies are not asked again."
    )
