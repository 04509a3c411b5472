"""Developer tools of the source tree, run from the repository root
(``python -m tools.sass``); not part of the installed package (setup.py names the
packages it installs). A regular package, not a namespace one, so that a
``tools`` package installed elsewhere cannot shadow it."""
