package kubevirtsim

import (
	"slices"
	"testing"
	"time"
)

func TestLegacyAttachDetachV17(t *testing.T) {
	s, ns := testSim(t, Options{Mode: ModeLegacy, Profile: ProfileV17})
	ctx := testCtx(t, 60*time.Second)
	if _, err := s.CreatePVC(ctx, ns, "pvc-a", "1Gi", false); err != nil {
		t.Fatal(err)
	}
	if _, err := s.CreateVM(ctx, VMSpec{Namespace: ns, Name: "vm1"}); err != nil {
		t.Fatal(err)
	}
	log := recordPhases(s, ns, "vm1")
	expect202(t, addVolume(t, s, ns, "vm1", "pvc-a"))
	if got := ready(t, s, ns, "vm1", "pvc-a", 20*time.Second); got != "sda" {
		t.Errorf("target %q, want sda", got)
	}
	vm, vmi := s.VM(ns, "vm1")
	if len(vm.Status.VolumeRequests) != 0 {
		t.Errorf("volumeRequests not trimmed: %+v", vm.Status.VolumeRequests)
	}
	if !hasVolume(vmi.Spec.Volumes, "pvc-a") {
		t.Errorf("VMI spec lacks the volume")
	}
	want := []string{"Bound", "AttachedToNode", "MountedToPod", "Ready"}
	if got := log.get("pvc-a"); !slices.Equal(got, want) {
		t.Errorf("add phases %v, want %v", got, want)
	}
	expect202(t, removeVolume(t, s, ns, "vm1", "pvc-a"))
	detached(t, s, ns, "vm1", "pvc-a", 20*time.Second)
	want = []string{"Bound", "AttachedToNode", "MountedToPod", "Ready", "UnMountedFromPod", "Detaching", "-"}
	if got := log.get("pvc-a"); !slices.Equal(got, want) {
		t.Errorf("phases %v, want %v", got, want)
	}
}
