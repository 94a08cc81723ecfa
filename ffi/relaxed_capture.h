// The calling thread's stream-capture mode relaxed for the life of the object, then restored,
// for ffi/triton_launch.cc and ffi/aiter_asm.cc. XLA records a custom call into a command buffer
// by capturing its stream, and a capture in global or thread-local mode refuses a module load
// on the capturing thread; a module load is not a stream operation, so nothing of it enters
// the captured graph. `exchange` is the driver's cuThreadExchangeStreamCaptureMode /
// hipThreadExchangeStreamCaptureMode (RELAXED is 2 in both enums), or null when the driver
// lacks it (then nothing changes).

#ifndef JAX_MLA_FFI_RELAXED_CAPTURE_H_
#define JAX_MLA_FFI_RELAXED_CAPTURE_H_

namespace jax_mla {

class RelaxedCapture {
 public:
  using Exchange = int (*)(int* mode);
  static constexpr int kRelaxed = 2;  // CU_STREAM_CAPTURE_MODE_RELAXED, hipStreamCaptureModeRelaxed

  explicit RelaxedCapture(Exchange exchange) : exchange_(exchange) {
    active_ = exchange_ != nullptr && exchange_(&mode_) == 0;
  }
  ~RelaxedCapture() {
    if (active_) exchange_(&mode_);
  }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  Exchange exchange_;
  int mode_ = kRelaxed;  // after the first exchange: the mode to restore
  bool active_ = false;
};

}  // namespace jax_mla

#endif  // JAX_MLA_FFI_RELAXED_CAPTURE_H_
