"""One package per op, each owning its whole path: ``contract`` (the checks and the options
type) -> backend and strategy -> the autograd Function."""
