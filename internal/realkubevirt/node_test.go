package realkubevirt

import (
	"testing"

	kubevirtv1 "kubevirt.io/api/core/v1"
)

func TestDiskLettersFollowTheKernel(t *testing.T) {
	for i, want := range map[int]string{0: "a", 25: "z", 26: "aa", 27: "ab", 701: "zz", 702: "aaa"} {
		if got := diskLetters(i); got != want {
			t.Errorf("diskLetters(%d) = %q, want %q", i, got, want)
		}
	}
}

// The virt-handler stand-in moves a hotplug entry one step per sync, only
// from the phases virt-handler's guards allow: mounted once virt-controller
// names an attachment pod, Ready with the first free target, and detached
// and UnMountedFromPod once the volume left the spec.
func TestHandlerStepsAHotplugVolumeLikeVirtHandler(t *testing.T) {
	a := newNodeAgents(nil, nil, nil, []string{"n"})
	vmi := &kubevirtv1.VirtualMachineInstance{}
	vmi.UID = "vmi-uid"
	vmi.Status.Phase = kubevirtv1.Running
	vmi.Spec.Volumes = []kubevirtv1.Volume{{Name: "old"}, {Name: "new"}}
	vmi.Status.VolumeStatus = []kubevirtv1.VolumeStatus{
		{Name: "old", Target: "sda", Phase: kubevirtv1.VolumeReady, HotplugVolume: &kubevirtv1.HotplugVolumeStatus{AttachPodUID: "pod-1"}},
		{Name: "new", Phase: kubevirtv1.VolumeBound, HotplugVolume: &kubevirtv1.HotplugVolumeStatus{}},
	}
	entry := func(name string) kubevirtv1.VolumeStatus {
		for _, e := range vmi.Status.VolumeStatus {
			if e.Name == name {
				return e
			}
		}
		t.Fatalf("no entry %s", name)
		return kubevirtv1.VolumeStatus{}
	}
	step := func(wantPhase kubevirtv1.VolumePhase, wantTarget string) {
		t.Helper()
		a.hotplug(vmi)
		if e := entry("new"); e.Phase != wantPhase || e.Target != wantTarget {
			t.Fatalf("entry new = %s target %q, want %s target %q", e.Phase, e.Target, wantPhase, wantTarget)
		}
	}

	step(kubevirtv1.VolumeBound, "") // no attachment pod named yet: nothing to mount
	vmi.Status.VolumeStatus[1].Phase = kubevirtv1.HotplugVolumeAttachedToNode
	vmi.Status.VolumeStatus[1].HotplugVolume.AttachPodUID = "pod-2"
	step(kubevirtv1.HotplugVolumeMounted, "")
	step(kubevirtv1.VolumeReady, "sdb") // sda is taken by the other volume
	vmi.Spec.Volumes = vmi.Spec.Volumes[:1]
	step(kubevirtv1.HotplugVolumeUnMounted, "")
	step(kubevirtv1.HotplugVolumeUnMounted, "") // stays until virt-controller drops it
	if e := entry("old"); e.Phase != kubevirtv1.VolumeReady || e.Target != "sda" {
		t.Errorf("untouched volume moved: %s target %q", e.Phase, e.Target)
	}
}
