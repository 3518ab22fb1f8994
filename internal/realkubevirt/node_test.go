package realkubevirt

import (
	"context"
	"errors"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/cache"
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
	a := newNodeAgents(nil, nil, nil, []string{"n"}, nil)
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
		a.hotplug(context.Background(), vmi)
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

// hookLog is a disk hook that records its calls and fails while fail is set.
type hookLog struct {
	calls []string
	fail  bool
}

func (h *hookLog) Plug(_ context.Context, vm, volume, claim string) error {
	h.calls = append(h.calls, "plug "+vm+" "+volume+" "+claim)
	if h.fail {
		return errors.New("not yet")
	}
	return nil
}

func (h *hookLog) Unplug(_ context.Context, vm, volume string) error {
	h.calls = append(h.calls, "unplug "+vm+" "+volume)
	if h.fail {
		return errors.New("busy")
	}
	return nil
}

// The host's disks follow the stand-in as they follow the simulator's
// virt-handler: a volume turns Ready only once its disk is plugged, and is
// UnMountedFromPod only once its disk is unplugged; a failing hook holds the
// entry where it is.
func TestHandlerRunsTheDiskHook(t *testing.T) {
	hook := &hookLog{fail: true}
	a := newNodeAgents(nil, nil, nil, []string{"n"}, hook)
	defer a.queue.ShutDown()
	vmi := &kubevirtv1.VirtualMachineInstance{}
	vmi.Namespace, vmi.Name, vmi.UID = "guests", "vm-0", "vmi-uid"
	vmi.Status.Phase = kubevirtv1.Running
	vmi.Spec.Volumes = []kubevirtv1.Volume{{Name: "pvc-1", VolumeSource: kubevirtv1.VolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
		PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: "claim-1"}, Hotpluggable: true}}}}
	vmi.Status.VolumeStatus = []kubevirtv1.VolumeStatus{{Name: "pvc-1", Phase: kubevirtv1.HotplugVolumeAttachedToNode,
		HotplugVolume: &kubevirtv1.HotplugVolumeStatus{AttachPodUID: "pod-1"}}}
	step := func(want kubevirtv1.VolumePhase) {
		t.Helper()
		a.hotplug(context.Background(), vmi)
		if e := vmi.Status.VolumeStatus[0]; e.Phase != want {
			t.Fatalf("entry = %s target %q, want %s (hook calls %q)", e.Phase, e.Target, want, hook.calls)
		}
	}
	step(kubevirtv1.HotplugVolumeMounted)
	step(kubevirtv1.HotplugVolumeMounted) // the plug failed: no target
	hook.fail = false
	step(kubevirtv1.VolumeReady)
	vmi.Spec.Volumes = nil
	hook.fail = true
	step(kubevirtv1.VolumeReady) // the unplug failed: still mounted
	hook.fail = false
	step(kubevirtv1.HotplugVolumeUnMounted)
	want := []string{"plug guests/vm-0 pvc-1 claim-1", "plug guests/vm-0 pvc-1 claim-1", "unplug guests/vm-0 pvc-1", "unplug guests/vm-0 pvc-1"}
	if !slices.Equal(hook.calls, want) {
		t.Errorf("hook calls %q, want %q", hook.calls, want)
	}
}

// With real kubelets on the host nodes the kubelet stand-in stands aside:
// it binds no pod and writes no pod status; without, it binds a launcher.
func TestKubeletStandInStandsAsideForRealKubelets(t *testing.T) {
	for _, kubelets := range []bool{true, false} {
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "virt-launcher-vm-x", Namespace: "guests",
			Labels: map[string]string{kubevirtv1.AppLabel: launcherLabelValue}}}
		kube := fake.NewClientset(pod)
		a := newNodeAgents(kube, nil, nil, []string{"n"}, nil)
		a.kubelets = kubelets
		a.pods = cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
		if err := a.pods.Add(pod); err != nil {
			t.Fatal(err)
		}
		if err := a.syncPod(context.Background(), pod.Namespace, pod.Name); err != nil {
			t.Fatal(err)
		}
		var writes []string
		for _, act := range kube.Actions() {
			writes = append(writes, act.GetVerb()+" "+act.GetResource().Resource+"/"+act.GetSubresource())
		}
		if kubelets && len(writes) != 0 {
			t.Errorf("with real kubelets the stand-in wrote %v, want nothing", writes)
		}
		if !kubelets && !slices.Contains(writes, "create pods/binding") {
			t.Errorf("without real kubelets the stand-in wrote %v, want the launcher bound", writes)
		}
	}
}
