"""The packages pipecc installs, found rather than listed: every package under each folder of
setup.cfg's `package_dir` (pipecc/, and passes/, backends/, models/ installed as pipecc.passes,
pipecc.backends, pipecc.models), so a new package (a technique's `pipecc/techniques/<name>/`)
needs no line of its own. setup.cfg cannot say this (its `find:` names a package by its folder:
backends/torch would install as `backends.torch`); everything else is setup.cfg's."""

import configparser
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
config = configparser.ConfigParser()
config.read(HERE / "setup.cfg")
# installed name -> folder (setup.cfg's package_dir)
FOLDERS = dict((name.strip(), folder.strip()) for name, _, folder in
               (line.partition("=") for line in config["options"]["package_dir"].splitlines() if line.strip()))

setup(packages=[f"{name}.{sub}" if sub else name
                for name, folder in FOLDERS.items() for sub in ["", *find_packages(str(HERE / folder))]])
