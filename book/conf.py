"""Sphinx configuration of ``make book`` (tools/book.py stages the pages, then runs Sphinx
with ``-c book``). MyST-NB renders each lesson's stored outputs and executes nothing; the
Sphinx Book Theme and Sphinx's own search ship in the output folder, so the site works offline.
"""

project = "Efficient training of transformer models on a single GPU"
author = "the course's contributors"
copyright = "2026, " + author

extensions = ["myst_nb"]
# The lessons come executed by make test (tools/keep_executed.py): show those outputs as they are.
nb_execution_mode = "off"
nb_output_stderr = "show"
nb_merge_streams = True
# No widget script from a CDN: progress bars are off in make test, and see below.
nb_ipywidgets_js = {}
# A widget output (lesson 15's calculator) shows its static HTML, which its kernel also sent: a
# page has no kernel to draw the widget from its state.
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]
# Pages render on their own: no notebook-wide Jupyter cache.
exclude_patterns = ["_build", "**.ipynb_checkpoints", ".ipython"]
suppress_warnings = ["myst.header"]  # README and the lessons skip heading levels on purpose

html_theme = "sphinx_book_theme"
html_title = "Efficient training on a single GPU"
html_theme_options = {
    "repository_url": "https://github.com/single-gpu-course/single-gpu-course",
    "use_repository_button": True,
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "use_download_button": False,
    # Lesson pages: no section list on the right, their figures take its width (course.css).
    "secondary_sidebar_items": {
        "index": ["page-toc"],
        "cheatsheet": ["page-toc"],
        "gpu/*": ["page-toc"],
        "recipes/*": ["page-toc"],
        "lessons/*": [],
    },  # it links to _sources/, which the site does not copy
}
# Unset, the theme logs "Got invalid theme mode" as a console error on every page.
html_context = {"default_mode": "light"}
html_static_path = ["_static"]
html_css_files = ["course.css"]
html_favicon = "_static/favicon.svg"  # else every browser's request for one is a 404
html_last_updated_fmt = ""
html_copy_source = False
html_show_sourcelink = False
