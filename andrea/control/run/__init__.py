"""One training process: the step engine, the asyncio loop, the step boundary, signals, resume, identity."""
