"""Pictures: feature-map grids and heat maps (a device half, then a host half), and Grad-CAM.

* :mod:`~actviz.pictures.rendering`: feature-map grids and heat maps;
* :mod:`~actviz.pictures.heatmap_sources`: heat maps' colours and sizes, bounded on the device;
* :mod:`~actviz.pictures.gradcam`: Grad-CAM of one layer.

Example:
    >>> from actviz.pictures.rendering import grid_layout
    >>> grid_layout(64, 52, 52)   # 8 x 8 tiles of 52 px with 2 px gaps
    (434, 434)
"""
