package simhost

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"kubevirt.io/client-go/kubevirt"

	"github.com/harvester-csi/harvester-csi-driver/internal/realkubevirt"
	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
)

// envOptions are the control plane's options: KubeVirt's own control plane
// needs ServiceAccount admission, aggregation and its identities.
func (h *Host) envOptions(dir string) testenv.Options {
	o := testenv.Options{Dir: dir}
	if h.o.Real != "" {
		o = realkubevirt.EnvOptions(o)
	}
	return o
}

// realMode is the KubeVirt CR's hotplug mode on the real control plane: the
// simulator's mode, which names the same gates.
func (h *Host) realMode() (realkubevirt.Mode, error) {
	m := realkubevirt.Mode(h.o.Sim.Mode)
	if _, err := realkubevirt.FeatureGates(m); err != nil {
		return "", fmt.Errorf("simhost: Real needs Sim.Mode legacy or declarative: %w", err)
	}
	return m, nil
}

// realOptions are the real control plane's options: the node agents play
// RealRelease's virt-handler, with stage timings at the simulator's scale
// and jitter, so a scenario's pace is the same on both hosts.
func (h *Host) realOptions(mode realkubevirt.Mode) realkubevirt.Options {
	return realkubevirt.Options{Mode: mode, Release: h.o.RealRelease, Scale: h.o.Sim.Scale, Jitter: h.o.Sim.Jitter, Seed: h.o.Sim.Seed}
}

// startReal runs KubeVirt's own virt-controller and virt-api (and its node
// agent stand-ins) where the simulator would run, with Harvester's storage
// class and a claim binder in the provisioner's place.
func (h *Host) startReal(ctx, runCtx context.Context) error {
	mode, err := h.realMode()
	if err != nil {
		return err
	}
	ro := h.realOptions(mode)
	h.realKubeVirtNodes(&ro)
	if h.o.Disks {
		hook, err := h.newDisks()
		if err != nil {
			return err
		}
		ro.Disks = hook
	}
	if h.Real, err = realkubevirt.Start(ctx, h.Env, h.o.Real, ro); err != nil {
		return fmt.Errorf("KubeVirt %s control plane: %w", h.o.Real, err)
	}
	if h.KubeVirt, err = kubevirt.NewForConfig(h.Env.Config); err != nil {
		return err
	}
	if h.nodes != nil {
		if err := h.startHostStorage(ctx, runCtx); err != nil {
			return fmt.Errorf("host storage: %w", err)
		}
	}
	if err := h.createStorageClass(ctx); err != nil {
		return err
	}
	b := &binder{kube: h.Kube, namespace: h.Namespace, class: h.StorageClass(),
		classless: h.o.Harvester || h.o.Sim.BindClasslessPVCs, longhorn: h.Longhorn}
	if err := b.run(runCtx); err != nil {
		return fmt.Errorf("claim binder: %w", err)
	}
	if h.o.Harvester {
		if err := h.harvesterDefaults(ctx); err != nil {
			return err
		}
	}
	return nil
}

// rootDiskImage is the guest VMs' container disk; no image is pulled. It is
// pinned by digest, as the kubelet then reports it in the container's
// imageID: virt-controller renders a migration target pod only from a
// container disk it can name by digest (kubevirt v1.7.0
// pkg/virt-controller/services/template.go:268,
// pkg/container-disk/container-disk.go:418-431), and a hollow kubelet
// reports the image reference it was given.
const rootDiskImage = "rootdisk@sha256:" + "5f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0"

// createRealVM creates a running VM as Harvester's are (a boot disk, pod
// network, memory) and returns once its VMI runs.
func (h *Host) createRealVM(ctx context.Context, name string) error {
	always := kubevirtv1.RunStrategyAlways
	vm := &kubevirtv1.VirtualMachine{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: h.Namespace},
		Spec: kubevirtv1.VirtualMachineSpec{
			RunStrategy: &always,
			Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{vmNameLabel: name}},
				Spec: kubevirtv1.VirtualMachineInstanceSpec{
					Domain: kubevirtv1.DomainSpec{
						Resources: kubevirtv1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("1Gi")}},
						Devices: kubevirtv1.Devices{Disks: []kubevirtv1.Disk{{
							Name: "rootdisk", BootOrder: ptr.To[uint](1),
							DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusVirtio}},
						}}},
					},
					Volumes: []kubevirtv1.Volume{{
						Name:         "rootdisk",
						VolumeSource: kubevirtv1.VolumeSource{ContainerDisk: &kubevirtv1.ContainerDiskSource{Image: rootDiskImage}},
					}},
				},
			},
		},
	}
	h.place(&vm.Spec.Template.Spec, name)
	if _, err := h.KubeVirt.KubevirtV1().VirtualMachines(h.Namespace).Create(ctx, vm, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	running := func(ctx context.Context) (bool, string) {
		vmi, err := h.KubeVirt.KubevirtV1().VirtualMachineInstances(h.Namespace).Get(ctx, name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			return false, "no VMI yet"
		case err != nil:
			return false, err.Error()
		}
		return vmi.Status.Phase == kubevirtv1.Running, "VMI " + string(vmi.Status.Phase)
	}
	restart := func(ctx context.Context) error {
		err := h.KubeVirt.KubevirtV1().VirtualMachineInstances(h.Namespace).Delete(ctx, name, metav1.DeleteOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		return err
	}
	return startRunning(ctx, name, vmStartAttempts, vmStartTimeout, running, restart)
}

// A VMI of KubeVirt v1.6 can stay Pending for good on this host's
// Kubernetes: virt-controller adds the launcher pod's readiness-gate
// condition with a JSON patch that tests the pod's whole condition list as
// it decoded it (kubevirt v1.6.0
// pkg/virt-controller/watch/vmi/lifecycle.go:772-817, 1072-1081), and its
// k8s.io/api v0.32 drops the conditions' observedGeneration, which the
// kubelet fills in from Kubernetes 1.34 on. Once the kubelet has written the
// pod's conditions before virt-controller's first patch, every patch fails
// its test and the VMI never leaves Pending. An operator restarts such a VM;
// the host does the same at start-up, so that a run is about hotplug and not
// about this start race.
const (
	vmStartAttempts = 3
	vmStartTimeout  = 90 * time.Second
)

// startRunning waits until running reports the VM's VMI running. A VMI not
// running within timeout is restarted, attempts-1 times at most; the last
// attempt waits as long as ctx allows, since a loaded machine may simply be
// slow.
func startRunning(ctx context.Context, name string, attempts int, timeout time.Duration,
	running func(context.Context) (bool, string), restart func(context.Context) error) error {
	var last string
	poll := func(ctx context.Context) (bool, error) {
		var ok bool
		ok, last = running(ctx)
		return ok, nil
	}
	for attempt := 1; attempt < attempts; attempt++ {
		err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, timeout, true, poll)
		switch {
		case err == nil:
			return nil
		case ctx.Err() != nil:
			return fmt.Errorf("VMI %s not running (%s): %w", name, last, err)
		}
		klog.FromContext(ctx).Info("VMI did not start; restarting it", "vm", name, "attempt", attempt, "state", last)
		if err := restart(ctx); err != nil {
			return fmt.Errorf("restarting VMI %s: %w", name, err)
		}
	}
	if err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, poll); err != nil {
		return fmt.Errorf("VMI %s not running after %d restarts (%s): %w", name, attempts-1, last, err)
	}
	return nil
}

// createRealPVC creates a bound host PVC of Harvester's class; the binder
// binds it.
func (h *Host) createRealPVC(ctx context.Context, name, size string) error {
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: h.Namespace},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany},
			VolumeMode:       ptr.To(corev1.PersistentVolumeBlock),
			StorageClassName: ptr.To(h.StorageClass()),
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(size)}},
		},
	}
	if _, err := h.Kube.CoreV1().PersistentVolumeClaims(h.Namespace).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
		return err
	}
	return wait.PollUntilContextCancel(ctx, 50*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		cur, err := h.Kube.CoreV1().PersistentVolumeClaims(h.Namespace).Get(ctx, name, metav1.GetOptions{})
		return err == nil && cur.Status.Phase == corev1.ClaimBound, nil
	})
}

// ClientConfig is the host identity a driver in the tests uses: the
// simulator's admin through its counting front proxy, or the admin on the
// real control plane (the same identity, without the counters).
func (h *Host) ClientConfig() *rest.Config {
	if h.Sim != nil {
		return h.Sim.ClientConfig()
	}
	return rest.CopyConfig(h.Env.Config)
}

// DeleteVM deletes a guest VM, on either control plane.
func (h *Host) DeleteVM(ctx context.Context, name string) error {
	if h.Sim != nil {
		return h.Sim.DeleteVM(ctx, h.Namespace, name)
	}
	return h.KubeVirt.KubevirtV1().VirtualMachines(h.Namespace).Delete(ctx, name, metav1.DeleteOptions{})
}

// StopVM powers a guest VM off and returns once its VMI is gone.
func (h *Host) StopVM(ctx context.Context, name string) error {
	if h.Sim != nil {
		if err := h.Sim.StopVM(ctx, h.Namespace, name); err != nil {
			return err
		}
		return h.Sim.Wait(ctx, h.Namespace, name, func(_ *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool { return vmi == nil })
	}
	if err := h.setRunStrategy(ctx, name, kubevirtv1.RunStrategyHalted); err != nil {
		return err
	}
	return wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		_, err := h.KubeVirt.KubevirtV1().VirtualMachineInstances(h.Namespace).Get(ctx, name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	})
}

// StartVM powers a stopped guest VM on again.
func (h *Host) StartVM(ctx context.Context, name string) error {
	if h.Sim != nil {
		return h.Sim.StartVM(ctx, h.Namespace, name)
	}
	return h.setRunStrategy(ctx, name, kubevirtv1.RunStrategyAlways)
}

func (h *Host) setRunStrategy(ctx context.Context, name string, rs kubevirtv1.VirtualMachineRunStrategy) error {
	patch := []byte(`{"spec":{"runStrategy":"` + string(rs) + `"}}`)
	_, err := h.KubeVirt.KubevirtV1().VirtualMachines(h.Namespace).Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{})
	return err
}

// VM is a guest VM and its VMI, either nil when absent: the simulator's
// cached copies, or live reads from KubeVirt's real control plane.
func (h *Host) VM(ctx context.Context, name string) (*kubevirtv1.VirtualMachine, *kubevirtv1.VirtualMachineInstance) {
	if h.Sim != nil {
		return h.Sim.VM(h.Namespace, name)
	}
	vm, err := h.KubeVirt.KubevirtV1().VirtualMachines(h.Namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		vm = nil
	}
	vmi, err := h.KubeVirt.KubevirtV1().VirtualMachineInstances(h.Namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		vmi = nil
	}
	return vm, vmi
}
