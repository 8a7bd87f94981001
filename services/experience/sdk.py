"""The trainer SDK's former import path: everything here is :mod:`fastexp`'s (``from fastexp import
ExperienceClient``), which installs without the services' dependencies. Kept so existing trainer code runs."""

from fastexp.client import *  # noqa: F403
from fastexp.client import __all__  # noqa: F401
