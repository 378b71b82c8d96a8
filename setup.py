"""Install snip_ds. All metadata lives in setup.cfg."""
from setuptools import setup

setup()
