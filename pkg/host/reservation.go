package host

import (
	"context"
	"errors"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// The reservation an exclusive attach puts on its volume's host PVC before
// writing the attach (pkg/hotplug): the VM it is for, the controller process
// that wrote it, and when, on that process's clock. It lives on the PVC
// because it is per volume, outlives every controller process, goes with the
// volume, and is seen by every guest cluster sharing the namespace.
const (
	ReservedForAnnotation = "driver.harvesterhci.io/hotplug-reserved-for"
	ReservedByAnnotation  = "driver.harvesterhci.io/hotplug-reserved-by"
	ReservedAtAnnotation  = "driver.harvesterhci.io/hotplug-reserved-at"
)

// Claim reads a host PVC and its reservation from the API server; one being
// deleted counts as gone.
func (c *Client) Claim(ctx context.Context, name string) (hotplug.HostClaim, error) {
	pvc, err := c.Kube.CoreV1().PersistentVolumeClaims(c.Namespace).Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return hotplug.HostClaim{}, nil
	case err != nil:
		return hotplug.HostClaim{}, err
	}
	return hostClaim(pvc), nil
}

// Reserve writes res on the PVC as read in from (the zero Reservation
// removes it), with the resourceVersion of that read as the precondition:
// the API server answers 409 Conflict when anyone changed the PVC since, so
// of two processes reserving from the same read exactly one succeeds. It is
// an update rather than a patch, the verb the driver already has on PVCs.
func (c *Client) Reserve(ctx context.Context, from hotplug.HostClaim, res hotplug.Reservation) (hotplug.HostClaim, error) {
	if from.Object == nil || from.Object.ResourceVersion == "" {
		return hotplug.HostClaim{}, errors.New("reserve: the host PVC was not read")
	}
	pvc := from.Object.DeepCopy()
	ann := make(map[string]string, len(pvc.Annotations)+3)
	for k, v := range pvc.Annotations {
		ann[k] = v
	}
	delete(ann, ReservedForAnnotation)
	delete(ann, ReservedByAnnotation)
	delete(ann, ReservedAtAnnotation)
	if !res.IsZero() {
		ann[ReservedForAnnotation] = res.VM
		ann[ReservedByAnnotation] = res.Holder
		ann[ReservedAtAnnotation] = res.At.UTC().Format(time.RFC3339Nano)
	}
	pvc.Annotations = ann
	out, err := c.Kube.CoreV1().PersistentVolumeClaims(c.Namespace).Update(ctx, pvc, metav1.UpdateOptions{})
	if err != nil {
		return hotplug.HostClaim{}, err
	}
	return hostClaim(out), nil
}

func hostClaim(pvc *corev1.PersistentVolumeClaim) hotplug.HostClaim {
	cl := hotplug.HostClaim{Phase: pvc.Status.Phase, Exists: pvc.DeletionTimestamp == nil, Object: pvc}
	cl.Reserved = reservationOf(pvc.Annotations)
	return cl
}

// reservationOf reads a reservation from a PVC's annotations. One without a
// readable time counts as written at the zero time, long expired: a hand
// edit must not fence a volume for ever.
func reservationOf(ann map[string]string) hotplug.Reservation {
	vm := ann[ReservedForAnnotation]
	if vm == "" {
		return hotplug.Reservation{}
	}
	at, _ := time.Parse(time.RFC3339Nano, ann[ReservedAtAnnotation])
	return hotplug.Reservation{VM: vm, Holder: ann[ReservedByAnnotation], At: at}
}
