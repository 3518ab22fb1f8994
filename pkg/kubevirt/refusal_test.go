package kubevirt

import (
	"errors"
	"testing"

	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

func TestRefusalFromTheVMCondition(t *testing.T) {
	vm := &kubevirtv1.VirtualMachine{}
	vm.Status.Conditions = []kubevirtv1.VirtualMachineCondition{{
		Type: kubevirtv1.VirtualMachineFailure, Status: "True", Reason: "FailedUpdateError",
		Message: `Error encountered when trying to update vm according to add volume requests: admission webhook "validator.harvesterhci.io" denied the request: the volume pvc-2 is already used by VM guests/other`,
	}}
	var passing *hotplug.PassingRefusal
	if err := Refusal(vm, "pvc-2"); err == nil || !errors.As(err, &passing) {
		t.Errorf("Harvester's occupied-claim refusal of the named volume = %v, want a PassingRefusal", err)
	}
	for _, other := range []string{"pvc-1", "pvc-20", "vc-2"} {
		if err := Refusal(vm, other); err != nil {
			t.Errorf("%s is not named but was refused: %v", other, err)
		}
	}
	vm.Status.Conditions[0].Message = `Error encountered when trying to update vm according to add volume requests: admission webhook "policy.example.com" denied the request: volume pvc-2 is refused by policy`
	if err := Refusal(vm, "pvc-2"); err == nil || errors.As(err, &passing) {
		t.Errorf("a policy's refusal of the named volume = %v, want a final refusal", err)
	}
	vm.Status.Conditions[0].Message = `Error encountered when trying to update vm according to add volume requests: admission webhook "virtualmachine-validator.kubevirt.io" denied the request: Cannot update vm disks or volumes until snapshot "pvc-2" completes`
	if err := Refusal(vm, "pvc-2"); err != nil {
		t.Errorf("a snapshot in progress is temporary, not a refusal: %v", err)
	}
	vm.Status.Conditions[0].Status = "False"
	if err := Refusal(vm, "pvc-2"); err != nil {
		t.Errorf("a cleared condition refuses nothing: %v", err)
	}
}

func TestNamesVolume(t *testing.T) {
	for _, tc := range []struct {
		msg, vol string
		want     bool
	}{
		{"volume pvc-2 denied", "pvc-2", true},
		{"pvc-2", "pvc-2", true},
		{"volume pvc-20 denied", "pvc-2", false},
		{"volume xpvc-2 and pvc-2 denied", "pvc-2", true},
		{"volume apvc-2", "pvc-2", false},
	} {
		if got := namesVolume(tc.msg, tc.vol); got != tc.want {
			t.Errorf("namesVolume(%q, %q) = %v, want %v", tc.msg, tc.vol, got, tc.want)
		}
	}
}
