"""Not imported as a package: this directory goes first on a subprocess worker's ``PYTHONPATH``
so that its ``sitecustomize.py`` runs at interpreter start (see ``elastictk.timer.boot``). The
file exists so that packaging (``find_packages``) ships the directory with elastictk."""
