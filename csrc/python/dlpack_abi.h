/*
 * dlpack_abi.h: the DLPack exchange structures (DLPack specification v1.x), declared
 * here from the specification's description of their layout so that the extension
 * needs no third-party header.  Only what tpcore's consumer (dlpack.c) and producer
 * (devarray.c) use.  The layouts are an ABI: field order and types must not change.
 *
 * Python capsule names: "dltensor_versioned" (a DLManagedTensorVersioned*),
 * "dltensor" (legacy DLManagedTensor*); a consumer renames the capsule to
 * "used_dltensor_versioned" / "used_dltensor" when it takes ownership and then calls
 * the deleter exactly once when done.
 */
#ifndef TPCORE_PYTHON_DLPACK_ABI_H
#define TPCORE_PYTHON_DLPACK_ABI_H

#include <stdint.h>

/* The version tpcore speaks (producer) and the highest it accepts (consumer). */
#define TP_DLPACK_MAJOR 1
#define TP_DLPACK_MINOR 1

/* DLDeviceType codes (the enum is int-sized in the specification). */
enum {
  TP_kDLCPU = 1,
  TP_kDLCUDA = 2,
  TP_kDLCUDAHost = 3,
  TP_kDLROCM = 10,
  TP_kDLROCMHost = 11,
  TP_kDLCUDAManaged = 13,
};

/* DLDataTypeCode values. */
enum {
  TP_kDLInt = 0,
  TP_kDLUInt = 1,
  TP_kDLFloat = 2,
  TP_kDLOpaqueHandle = 3,
  TP_kDLBfloat = 4,
  TP_kDLComplex = 5,
  TP_kDLBool = 6,
};

/* flags of the versioned tensor */
#define TP_DLPACK_FLAG_READ_ONLY ((uint64_t)1 << 0)
#define TP_DLPACK_FLAG_IS_COPIED ((uint64_t)1 << 1)
#define TP_DLPACK_FLAG_IS_SUBBYTE_TYPE_PADDED ((uint64_t)1 << 2)

typedef struct {
  int32_t device_type; /* DLDeviceType */
  int32_t device_id;
} DLDevice;

typedef struct {
  uint8_t code;   /* DLDataTypeCode */
  uint8_t bits;   /* bits per lane */
  uint16_t lanes; /* 1 for scalars */
} DLDataType;

typedef struct {
  void *data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t *shape;
  int64_t *strides; /* in elements; NULL = compact row-major */
  uint64_t byte_offset;
} DLTensor;

/* legacy (unversioned) managed tensor */
typedef struct DLManagedTensor {
  DLTensor dl_tensor;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

typedef struct {
  uint32_t major;
  uint32_t minor;
} DLPackVersion;

typedef struct DLManagedTensorVersioned {
  DLPackVersion version;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensorVersioned *self);
  uint64_t flags;
  DLTensor dl_tensor;
} DLManagedTensorVersioned;

#endif /* TPCORE_PYTHON_DLPACK_ABI_H */
