"""Parts of tools/device_check.py's --suite gpu that measure the span runtime on one device:
numerics.py (span attention in bf16 against fp32) and documents.py (packed documents' memory).
They live in the package so that the tool and the tests that show each part can fail share them.
"""
