"""Python: its program image so far (`image`: CPython 3.11 with numpy, pandas, matplotlib and scipy).

Not served yet: there is no child runner or gate policy, so there is no `Language` instance, `SERVED`
does not name python, and a request for it is refused (`languages.served_language`). `metaagent sandbox
build` builds the image when `METAAGENT_LANGUAGES` includes python, and `sandbox prune` prunes it.
"""
