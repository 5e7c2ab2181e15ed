"""Service plumbing shared by every Tandem process: flags from config dataclasses (`flags`),
serving a FastAPI app on a socket we bind ourselves with a request-size cap and a bounded
graceful shutdown (`serving`, `body_limit`), the run's bearer token (`auth`), URL fields
(`urls`) and reading an engine's weight version (`engine_info`). A library, like
`sample_buffer`: no process of its own, no import of any service."""
