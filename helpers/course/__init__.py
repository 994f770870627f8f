"""The course's own tools, the top floor of helpers: the only code that imports helpers.lessons.

``fullscale`` (what each lesson runs at the full scale, and whether the card holds it),
``preflight`` (every hardware feature the lessons use, tried here), ``cheatsheet`` (the
guide's methods with the ratios measured), ``calculator`` (the memory calculator for
JupyterLab: ``helpers.calculator()``), ``gpu_check`` (the course proven on a GPU) and ``cli``
(``python -m helpers ...``). Nothing below this package imports it.
"""
