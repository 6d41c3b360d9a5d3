"""`kvserve.utils.serial_utils`, as `vllm.utils.serial_utils`: tensors to base64 or bytes."""

from kvserve.engine.tensor_codec import (EMBED_DTYPES, ENDIANNESS, MM_METADATA_DTYPES, DTypeInfo,
                                         EmbedDType, EncodingFormat, Endianness, MmMetadataDType,
                                         binary2tensor, numpy2base64, tensor2base64, tensor2binary)

__all__ = ["EMBED_DTYPES", "ENDIANNESS", "MM_METADATA_DTYPES", "DTypeInfo", "EmbedDType",
           "EncodingFormat", "Endianness", "MmMetadataDType", "binary2tensor", "numpy2base64",
           "tensor2base64", "tensor2binary"]
