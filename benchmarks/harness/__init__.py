"""What the benchmarks share, one idea a module.

``env``: the package measured and what a result needs to be reproduced; ``timing``: the clock,
the timed loops and peak memory; ``step``: a loss step measured (forward and backward apart,
memory, error); ``errors``: error against a higher-precision reference;
``report``: the JSON, markdown and plot written side by side; ``plots``: the figures; ``dist``:
process groups and figures agreed over ranks; ``probes``: device yardsticks (copy bandwidth, host
overhead, the TP statistics collective); ``peers``: the implementations compared.
"""
