"""The lessons' own machinery: one module per notebook, named like it.

``notebooks/11_data_loading.ipynb`` imports ``helpers.lessons.data_loading``, and so on for
lessons 01-17 (lesson 00 needs only the core modules of ``helpers``); ``helpers.syllabus``
lists them. Each module's docstring
opens with the lesson and the sections it serves. Core machinery lives one level up; nothing
in the core imports a lesson module at import time (``helpers.course.fullscale``, ``preflight`` and
``cli`` reach for one inside the function that runs that lesson's part).
"""
