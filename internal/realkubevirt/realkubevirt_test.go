package realkubevirt

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

// versions are the KubeVirt tags with a tools module, the one Harvester 1.8
// runs first.
var versions = []string{"v1.7.0", "v1.6.0", "v1.8.2", "v1.8.4"}

// TestHotplugOnRealControlPlane adds a volume to a running VM and removes it
// again through each hotplug API, on each built KubeVirt version, and sees
// KubeVirt's own controllers carry it to Ready in the VMI status and out
// again, with only the node agents played here.
func TestHotplugOnRealControlPlane(t *testing.T) {
	bin, err := testenv.BinDir()
	if err != nil {
		t.Fatal(err)
	}
	for _, version := range versions {
		t.Run(version, func(t *testing.T) {
			if !Built(bin, version) {
				t.Skipf("KubeVirt %s binaries are not in %s: hack/tools.sh builds every tools/kubevirt-* module", version, bin)
			}
			for _, mode := range []Mode{Legacy, Declarative} {
				t.Run(string(mode), func(t *testing.T) { testHotplug(t, version, mode) })
			}
		})
	}
}

func testHotplug(t *testing.T, version string, mode Mode) {
	// A bound for a stalled control plane, not a speed limit: `make test`
	// shares the machine with the other packages' API servers.
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	env, err := testenv.Start(ctx, EnvOptions(testenv.Options{}))
	if err != nil {
		t.Fatal(err)
	}
	defer env.Stop()
	cp, err := Start(ctx, env, version, Options{Mode: mode})
	if err != nil {
		t.Fatal(err)
	}
	defer cp.Stop()
	kube := kubernetes.NewForConfigOrDie(env.Config)
	const ns, vmName, volume = "guests", "vm-0", "disk-1"
	if _, err := kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := kube.CoreV1().PersistentVolumeClaims(ns).Create(ctx, blockClaim(volume), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	vms := cp.KubeVirt.KubevirtV1().VirtualMachines(ns)
	if _, err := vms.Create(ctx, runningVM(vmName), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	vmis := cp.KubeVirt.KubevirtV1().VirtualMachineInstances(ns)
	// Each read gets its own bound, so the state reported on a timeout is
	// the last one seen and not the expired context's error.
	vmiState := func() (*kubevirtv1.VirtualMachineInstance, string) {
		readCtx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		vmi, err := vmis.Get(readCtx, vmName, metav1.GetOptions{})
		if err != nil {
			return nil, err.Error()
		}
		return vmi, fmt.Sprintf("phase %s, volumes %+v", vmi.Status.Phase, vmi.Status.VolumeStatus)
	}
	testwait.Until(ctx, t, "the VMI running", func() (bool, string) {
		vmi, state := vmiState()
		return vmi != nil && vmi.Status.Phase == kubevirtv1.Running, state
	})

	if mode == Legacy {
		err = vms.AddVolume(ctx, vmName, &kubevirtv1.AddVolumeOptions{
			Name:         volume,
			Disk:         scsiDisk(volume),
			VolumeSource: &kubevirtv1.HotplugVolumeSource{PersistentVolumeClaim: hotplugClaim(volume)},
		})
	} else {
		err = editVM(ctx, cp, ns, vmName, func(spec *kubevirtv1.VirtualMachineInstanceSpec) {
			spec.Domain.Devices.Disks = append(spec.Domain.Devices.Disks, *scsiDisk(volume))
			spec.Volumes = append(spec.Volumes, kubevirtv1.Volume{Name: volume, VolumeSource: kubevirtv1.VolumeSource{PersistentVolumeClaim: hotplugClaim(volume)}})
		})
	}
	if err != nil {
		t.Fatalf("add %s: %v", volume, err)
	}
	testwait.Until(ctx, t, "the hot-plugged volume Ready with a target", func() (bool, string) {
		vmi, state := vmiState()
		if vmi == nil {
			return false, state
		}
		i := slices.IndexFunc(vmi.Status.VolumeStatus, func(e kubevirtv1.VolumeStatus) bool { return e.Name == volume })
		return i >= 0 && vmi.Status.VolumeStatus[i].Phase == kubevirtv1.VolumeReady && vmi.Status.VolumeStatus[i].Target != "" &&
			vmi.Status.VolumeStatus[i].HotplugVolume != nil && vmi.Status.VolumeStatus[i].HotplugVolume.AttachPodUID != "", state
	})

	if mode == Legacy {
		err = vms.RemoveVolume(ctx, vmName, &kubevirtv1.RemoveVolumeOptions{Name: volume})
	} else {
		err = editVM(ctx, cp, ns, vmName, func(spec *kubevirtv1.VirtualMachineInstanceSpec) {
			spec.Domain.Devices.Disks = slices.DeleteFunc(spec.Domain.Devices.Disks, func(d kubevirtv1.Disk) bool { return d.Name == volume })
			spec.Volumes = slices.DeleteFunc(spec.Volumes, func(v kubevirtv1.Volume) bool { return v.Name == volume })
		})
	}
	if err != nil {
		t.Fatalf("remove %s: %v", volume, err)
	}
	testwait.Until(ctx, t, "the volume gone from the VMI and its attachment pod gone", func() (bool, string) {
		vmi, state := vmiState()
		if vmi == nil {
			return false, state
		}
		pods, err := kube.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: kubevirtv1.AppLabel + "=" + attachmentLabelValue})
		if err != nil {
			return false, err.Error()
		}
		inStatus := slices.ContainsFunc(vmi.Status.VolumeStatus, func(e kubevirtv1.VolumeStatus) bool { return e.Name == volume })
		inSpec := slices.ContainsFunc(vmi.Spec.Volumes, func(v kubevirtv1.Volume) bool { return v.Name == volume })
		return !inStatus && !inSpec && len(pods.Items) == 0, fmt.Sprintf("%s; %d attachment pods", state, len(pods.Items))
	})

	// Deleting the VM runs the node side of a shutdown: virt-handler
	// reports the VMI Succeeded and the kubelet finishes the launcher's
	// deletion, after which KubeVirt drops its finalizers.
	if err := vms.Delete(ctx, vmName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testwait.Until(ctx, t, "the VMI and its virt-launcher pod gone", func() (bool, string) {
		_, err := vmis.Get(ctx, vmName, metav1.GetOptions{})
		pods, perr := kube.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: kubevirtv1.AppLabel + "=" + launcherLabelValue})
		if perr != nil {
			return false, perr.Error()
		}
		return apierrors.IsNotFound(err) && len(pods.Items) == 0, fmt.Sprintf("VMI get: %v; %d launcher pods", err, len(pods.Items))
	})
}

// editVM changes the VM's template as a declarative client does, retrying on
// the conflicts virt-controller's own writes cause.
func editVM(ctx context.Context, cp *ControlPlane, ns, name string, edit func(*kubevirtv1.VirtualMachineInstanceSpec)) error {
	vms := cp.KubeVirt.KubevirtV1().VirtualMachines(ns)
	for {
		vm, err := vms.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		edit(&vm.Spec.Template.Spec)
		_, err = vms.Update(ctx, vm, metav1.UpdateOptions{})
		if err == nil || ctx.Err() != nil || !isConflict(err) {
			return err
		}
	}
}

func runningVM(name string) *kubevirtv1.VirtualMachine {
	always := kubevirtv1.RunStrategyAlways
	return &kubevirtv1.VirtualMachine{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: kubevirtv1.VirtualMachineSpec{
			RunStrategy: &always,
			Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{Spec: kubevirtv1.VirtualMachineInstanceSpec{
				Domain: kubevirtv1.DomainSpec{
					Resources: kubevirtv1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("64Mi")}},
					Devices:   kubevirtv1.Devices{Disks: []kubevirtv1.Disk{{Name: "root", DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusVirtio}}}}},
				},
				Volumes: []kubevirtv1.Volume{{Name: "root", VolumeSource: kubevirtv1.VolumeSource{ContainerDisk: &kubevirtv1.ContainerDiskSource{Image: "root-disk"}}}},
			}},
		},
	}
}

func blockClaim(name string) *corev1.PersistentVolumeClaim {
	block := corev1.PersistentVolumeBlock
	return &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany},
			VolumeMode:  &block,
			Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}
}

func scsiDisk(name string) *kubevirtv1.Disk {
	return &kubevirtv1.Disk{Name: name, DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusSCSI}}}
}

func hotplugClaim(name string) *kubevirtv1.PersistentVolumeClaimVolumeSource {
	return &kubevirtv1.PersistentVolumeClaimVolumeSource{
		PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: name},
		Hotpluggable:                      true,
	}
}

func isConflict(err error) bool { return apierrors.IsConflict(err) }
