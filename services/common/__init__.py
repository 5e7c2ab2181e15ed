"""Service plumbing shared by every Tandem process: flags from config dataclasses (`flags`) and
serving a FastAPI app on a socket we bind ourselves (`serving`). A library, like
`sample_buffer`: no process of its own, no import of any service."""
