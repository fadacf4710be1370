"""`python -m app.demo`: build the demo model and adapters (see app/demo/build.py)."""

from app.demo.build import main

main()
