"""Entry points: ``python -m benchmarks --preset {smoke,cpu,gpu} [--out results.json]`` (the LDC
step in every precision mode, engines, memory) and ``python -m benchmarks matrix [--quick]``
(the DerivScaler's cost over a matrix of PINN problems, :mod:`benchmarks.matrix`) and
``python -m benchmarks roofline`` (XLA cost per mode and a GPU prediction, :mod:`benchmarks.roofline`) and
``python -m benchmarks peers`` (the Laplacian vs folx and jax.hessian, :mod:`benchmarks.peers`) and
``python -m benchmarks idioms`` (every way of writing derivatives vs the engine, :mod:`benchmarks.idioms`;
``idioms --random N --seed S``: random derivative programs, :mod:`benchmarks.idioms_random`)."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["matrix"]:
        from benchmarks.matrix import main as matrix_main

        matrix_main(sys.argv[2:])
    elif sys.argv[1:2] == ["peers"]:
        from benchmarks.peers import main as peers_main

        peers_main(sys.argv[2:])
    elif sys.argv[1:2] == ["idioms"] and any(a.split("=")[0] == "--random" for a in sys.argv[2:]):
        from benchmarks.idioms_random import main as idioms_random_main

        idioms_random_main(sys.argv[2:])
    elif sys.argv[1:2] == ["idioms"]:
        from benchmarks.idioms import main as idioms_main

        idioms_main(sys.argv[2:])
    elif sys.argv[1:2] == ["gpu_program"]:
        from benchmarks.gpu_program import main as gpu_program_main

        gpu_program_main(sys.argv[2:])
    elif sys.argv[1:2] == ["roofline"]:
        from benchmarks.roofline import main as roofline_main

        roofline_main(sys.argv[2:])
    else:
        from benchmarks.runner import main

        main()
