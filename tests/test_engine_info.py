"""An engine's weight version read from SGLang's JSON (a string there) is an int in Tandem; a
version that is not a number (SGLang's "default" before any update) reads as -1, unknown."""

from __future__ import annotations

from typing import ClassVar

from services.common.engine_info import weight_version
from tests.helpers import JsonHandler, serving


class ModelInfo(JsonHandler):
    answers: ClassVar[list[object]] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server names it
        self.send_json(200, {"model_path": "m", "weight_version": self.answers[0]})


def test_the_version_an_engine_reports_is_an_int_and_a_name_reads_as_unknown() -> None:
    for reported, read in [("12", 12), (3, 3), ("default", -1), ("-1", -1)]:
        handler = type("Info", (ModelInfo,), {"answers": [reported]})
        with serving(handler) as url:
            assert weight_version(url) == read, reported
