package realkubevirt

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

// realHost is one real control plane with a namespace of guests.
type realHost struct {
	t    *testing.T
	ctx  context.Context
	cp   *ControlPlane
	kube kubernetes.Interface
	ns   string
}

// TestHandlerReleaseBugsOnRealControlPlane runs virt-handler as KubeVirt
// v1.7.0 ships it (Harvester 1.8.0) under the real v1.7.0 virt-controller
// and shows its two wedges there, each on its own VM of one control plane:
// the first-UID reuse (an add waits behind a listed removal) and the remount
// deadlock of kubevirt PR 18044 (the real virt-controller keeps the old
// attachment pod while the removed volume stays Ready).
func TestHandlerReleaseBugsOnRealControlPlane(t *testing.T) {
	const version = "v1.7.0"
	bin, err := testenv.BinDir()
	if err != nil {
		t.Fatal(err)
	}
	if !Built(bin, version) {
		t.Skipf("KubeVirt %s binaries are not in %s: hack/tools.sh builds them", version, bin)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	env, err := testenv.Start(ctx, EnvOptions(testenv.Options{}))
	if err != nil {
		t.Fatal(err)
	}
	defer env.Stop()
	// Scaled so the I/O-error delays (10 s doubling) stay short.
	cp, err := Start(ctx, env, version, Options{Mode: Declarative, Scale: 0.1})
	if err != nil {
		t.Fatal(err)
	}
	defer cp.Stop()
	h := &realHost{t: t, ctx: ctx, cp: cp, kube: kubernetes.NewForConfigOrDie(env.Config), ns: "guests"}
	if _, err := h.kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: h.ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []string{"uid-a", "uid-b", "dl-a", "dl-b"} {
		if _, err := h.kube.CoreV1().PersistentVolumeClaims(h.ns).Create(ctx, blockClaim(c), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// The group returns once both parallel scenarios have, before the
	// deferred stops.
	t.Run("v1.7.0", func(t *testing.T) {
		t.Run("first-UID reuse", func(t *testing.T) {
			t.Parallel()
			h := *h
			h.t = t
			h.firstUIDReuse("vm-uid")
		})
		t.Run("remount deadlock", func(t *testing.T) {
			t.Parallel()
			h := *h
			h.t = t
			h.remountDeadlock("vm-dl")
		})
	})
}

// firstUIDReuse: uid-a's unmount fails, so its entry stays listed with the
// old pod; uid-b, added in the same update, sorts after it and waits.
func (h *realHost) firstUIDReuse(vm string) {
	h.startVM(vm)
	h.edit(vm, []string{"uid-a"}, nil)
	h.waitEntry(vm, "uid-a Ready", func(vmi *kubevirtv1.VirtualMachineInstance) bool {
		return phaseOf(vmi, "uid-a") == kubevirtv1.VolumeReady
	})
	h.cp.Faults().SetUnmountFails(h.ns+"/"+vm, "uid-a", true)
	h.edit(vm, []string{"uid-b"}, []string{"uid-a"})
	h.waitEntry(vm, "uid-b named with its attachment pod", func(vmi *kubevirtv1.VirtualMachineInstance) bool {
		e, ok := entryOf(vmi, "uid-b")
		return ok && e.HotplugVolume != nil && e.HotplugVolume.AttachPodUID != ""
	})
	h.waitEvent(vm, "HotplugFailed")
	h.waitPasses(vm, 3)
	vmi := h.vmi(vm)
	if p := phaseOf(vmi, "uid-b"); p != kubevirtv1.HotplugVolumeAttachedToNode || phaseOf(vmi, "uid-a") != kubevirtv1.VolumeReady {
		h.t.Fatalf("uid-b went on behind a listed removal: %s", describeVMI(vmi))
	}
	h.cp.Faults().SetUnmountFails(h.ns+"/"+vm, "uid-a", false)
	h.cp.Requeue(h.ns, vm)
	h.waitEntry(vm, "uid-b Ready once uid-a is gone", func(vmi *kubevirtv1.VirtualMachineInstance) bool {
		_, listed := entryOf(vmi, "uid-a")
		return !listed && phaseOf(vmi, "uid-b") == kubevirtv1.VolumeReady
	})
}

// remountDeadlock: dl-a and dl-b of one pod are removed together while
// dl-b's device vanished; dl-a is mounted again on every pass, the pass
// fails on dl-b before Unmount, and virt-controller keeps the pod.
func (h *realHost) remountDeadlock(vm string) {
	h.startVM(vm)
	h.edit(vm, []string{"dl-a", "dl-b"}, nil)
	h.waitEntry(vm, "dl-a and dl-b Ready", func(vmi *kubevirtv1.VirtualMachineInstance) bool {
		return phaseOf(vmi, "dl-a") == kubevirtv1.VolumeReady && phaseOf(vmi, "dl-b") == kubevirtv1.VolumeReady
	})
	h.cp.Faults().SetDeviceVanished(h.ns+"/"+vm, "dl-b", true)
	h.edit(vm, nil, []string{"dl-a", "dl-b"})
	h.waitEvent(vm, "SyncFailed")
	// dl-b leaves the domain. Which phase it shows then is a race of two
	// writers: virt-handler's UnMountedFromPod is allowed only from Ready
	// (v1.7.0 pkg/virt-handler/vm.go:447 canUpdateToUnmounted), so once
	// virt-controller has written Detaching first the entry keeps that.
	h.waitEntry(vm, "dl-b out of the domain (UnMountedFromPod or Detaching)", func(vmi *kubevirtv1.VirtualMachineInstance) bool {
		e, ok := entryOf(vmi, "dl-b")
		return ok && e.Target == "" && (e.Phase == kubevirtv1.HotplugVolumeUnMounted || e.Phase == kubevirtv1.HotplugVolumeDetaching)
	})
	h.waitPasses(vm, 5)
	vmi := h.vmi(vm)
	e, _ := entryOf(vmi, "dl-a")
	if e.Phase != kubevirtv1.VolumeReady || e.Target != "" || h.attachmentPods(vmi) != 1 {
		h.t.Fatalf("no deadlock: %s; %d attachment pods", describeVMI(vmi), h.attachmentPods(vmi))
	}
}

func (h *realHost) startVM(vm string) {
	h.t.Helper()
	if _, err := h.cp.KubeVirt.KubevirtV1().VirtualMachines(h.ns).Create(h.ctx, runningVM(vm), metav1.CreateOptions{}); err != nil {
		h.t.Fatal(err)
	}
	h.waitEntry(vm, "the VMI running", func(vmi *kubevirtv1.VirtualMachineInstance) bool { return vmi.Status.Phase == kubevirtv1.Running })
}

// edit adds and removes hotplug volumes (named after their claims) in one
// VM update.
func (h *realHost) edit(vm string, add, remove []string) {
	h.t.Helper()
	err := editVM(h.ctx, h.cp, h.ns, vm, func(spec *kubevirtv1.VirtualMachineInstanceSpec) {
		spec.Domain.Devices.Disks = slices.DeleteFunc(spec.Domain.Devices.Disks, func(d kubevirtv1.Disk) bool { return slices.Contains(remove, d.Name) })
		spec.Volumes = slices.DeleteFunc(spec.Volumes, func(v kubevirtv1.Volume) bool { return slices.Contains(remove, v.Name) })
		for _, name := range add {
			spec.Domain.Devices.Disks = append(spec.Domain.Devices.Disks, *scsiDisk(name))
			spec.Volumes = append(spec.Volumes, kubevirtv1.Volume{Name: name, VolumeSource: kubevirtv1.VolumeSource{PersistentVolumeClaim: hotplugClaim(name)}})
		}
	})
	if err != nil {
		h.t.Fatalf("edit %s: %v", vm, err)
	}
}

func (h *realHost) vmi(vm string) *kubevirtv1.VirtualMachineInstance {
	h.t.Helper()
	readCtx, cancel := context.WithTimeout(h.ctx, 10*time.Second)
	defer cancel()
	vmi, err := h.cp.KubeVirt.KubevirtV1().VirtualMachineInstances(h.ns).Get(readCtx, vm, metav1.GetOptions{})
	if err != nil {
		h.t.Fatal(err)
	}
	return vmi
}

func (h *realHost) waitEntry(vm, what string, cond func(*kubevirtv1.VirtualMachineInstance) bool) {
	h.t.Helper()
	testwait.Until(h.ctx, h.t, vm+": "+what, func() (bool, string) {
		readCtx, cancel := context.WithTimeout(h.ctx, 10*time.Second)
		defer cancel()
		vmi, err := h.cp.KubeVirt.KubevirtV1().VirtualMachineInstances(h.ns).Get(readCtx, vm, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		return cond(vmi), describeVMI(vmi)
	})
}

func (h *realHost) waitEvent(vm, reason string) {
	h.t.Helper()
	// A bound for a stalled control plane, well short of the test's, so a
	// release without the behaviour fails here rather than at the end.
	ctx, cancel := context.WithTimeout(h.ctx, 90*time.Second)
	defer cancel()
	testwait.Until(ctx, h.t, vm+": a "+reason+" Event from virt-handler", func() (bool, string) {
		evs, err := h.kube.CoreV1().Events(h.ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error()
		}
		var seen []string
		for _, e := range evs.Items {
			if e.InvolvedObject.Name == vm && e.Source.Component == "virt-handler" {
				if e.Reason == reason {
					return true, ""
				}
				seen = append(seen, e.Reason)
			}
		}
		return false, strings.Join(seen, ",")
	})
}

func (h *realHost) waitPasses(vm string, n int) {
	h.t.Helper()
	want := h.cp.Passes(h.ns, vm) + n
	testwait.Until(h.ctx, h.t, fmt.Sprintf("%s: %d virt-handler passes", vm, n), func() (bool, string) {
		return h.cp.Passes(h.ns, vm) >= want, fmt.Sprint(h.cp.Passes(h.ns, vm))
	})
}

// attachmentPods counts the VMI's attachment pods.
func (h *realHost) attachmentPods(vmi *kubevirtv1.VirtualMachineInstance) int {
	h.t.Helper()
	pods, err := h.kube.CoreV1().Pods(h.ns).List(h.ctx, metav1.ListOptions{LabelSelector: kubevirtv1.AppLabel + "=" + attachmentLabelValue})
	if err != nil {
		h.t.Fatal(err)
	}
	n := 0
	for _, p := range pods.Items {
		if slices.ContainsFunc(vmi.Status.VolumeStatus, func(e kubevirtv1.VolumeStatus) bool {
			return e.HotplugVolume != nil && e.HotplugVolume.AttachPodName == p.Name
		}) {
			n++
		}
	}
	return n
}

func entryOf(vmi *kubevirtv1.VirtualMachineInstance, name string) (kubevirtv1.VolumeStatus, bool) {
	i := slices.IndexFunc(vmi.Status.VolumeStatus, func(e kubevirtv1.VolumeStatus) bool { return e.Name == name })
	if i < 0 {
		return kubevirtv1.VolumeStatus{}, false
	}
	return vmi.Status.VolumeStatus[i], true
}

func phaseOf(vmi *kubevirtv1.VirtualMachineInstance, name string) kubevirtv1.VolumePhase {
	e, _ := entryOf(vmi, name)
	return e.Phase
}

func describeVMI(vmi *kubevirtv1.VirtualMachineInstance) string {
	var b strings.Builder
	fmt.Fprintf(&b, "phase %s", vmi.Status.Phase)
	for _, e := range vmi.Status.VolumeStatus {
		if e.HotplugVolume != nil {
			fmt.Fprintf(&b, "; %s %s target=%q pod=%s", e.Name, e.Phase, e.Target, e.HotplugVolume.AttachPodName)
		}
	}
	return b.String()
}
