"""The tool demo: the count-up task with a calculator tool, trained in-process or as an
OpenAI-client agent (`python -m laminar.demo.tooldemo`)."""
