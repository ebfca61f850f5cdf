"""federate prints one line per Flower event at INFO (issue 24): not twice, no per-node DEBUG."""

from __future__ import annotations

import io
import logging

from flwr.common.logger import FLOWER_LOGGER

from nimmer_train.federation.stage import quiet_flower_logging


def test_each_flower_event_is_one_info_line_in_the_jobs_handlers() -> None:
    saved_handlers, saved_level = list(FLOWER_LOGGER.handlers), FLOWER_LOGGER.level
    job = io.StringIO()
    root = logging.getLogger()
    handler = logging.StreamHandler(job)  # the job's console / log file (Hydra's handlers)
    root.addHandler(handler)
    flower_console = io.StringIO()
    console = FLOWER_LOGGER.handlers[0]
    stream = console.setStream(flower_console)  # Flower's own console handler
    try:
        quiet_flower_logging()
        FLOWER_LOGGER.debug("node 7: message received")
        FLOWER_LOGGER.info("[ROUND 1] configure_fit: strategy sampled 4 clients")
    finally:
        root.removeHandler(handler)
        FLOWER_LOGGER.handlers[:] = saved_handlers
        FLOWER_LOGGER.setLevel(saved_level)
        console.setStream(stream)
    assert job.getvalue().count("configure_fit") == 1 and "node 7" not in job.getvalue()
    assert flower_console.getvalue() == ""  # not printed a second time by Flower's own handler
