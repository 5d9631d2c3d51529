"""DFlash drafters: config, the model API and draft pass, the generic (z-lab) and Laguna kinds, the reduced draft vocabulary and the Gemma knobs."""
