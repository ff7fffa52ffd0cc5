"""The demos: `python -m laminar.demo` (the default job, `make run`) and
`python -m laminar.demo.tooldemo` (multi-turn tool use)."""
