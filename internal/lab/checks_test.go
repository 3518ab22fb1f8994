package lab

import (
	"testing"

	kubevirtv1 "kubevirt.io/api/core/v1"
)

// A stuck volume's context names each queued legacy request by what it
// asks for, not by the addresses of its options.
func TestDescribeRequest(t *testing.T) {
	for want, r := range map[string]kubevirtv1.VirtualMachineVolumeRequest{
		"add pvc-a":    {AddVolumeOptions: &kubevirtv1.AddVolumeOptions{Name: "pvc-a"}},
		"remove pvc-b": {RemoveVolumeOptions: &kubevirtv1.RemoveVolumeOptions{Name: "pvc-b"}},
		"(empty)":      {},
	} {
		if got := describeRequest(r); got != want {
			t.Errorf("describeRequest = %q, want %q", got, want)
		}
	}
}
