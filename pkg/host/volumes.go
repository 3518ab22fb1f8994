package host

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/util/retry"
)

// Host PVCs created by CreateVolume carry this label, so ListVolumes can tell
// them from the VMs' own disks in the same namespace.
const (
	VolumeLabel      = "app.kubernetes.io/managed-by"
	VolumeLabelValue = "driver.harvesterhci.io"
)

// AccessModeAnnotation on a host PVC says the guest volume was created
// ReadWriteMany (AccessModeShared): on the host both kinds are ReadWriteMany
// PVCs, and a shared one has its NetworkFilesystem only once it is bound.
const (
	AccessModeAnnotation = "driver.harvesterhci.io/access-mode"
	AccessModeShared     = "ReadWriteMany"
)

// VolumeSpec is the shape of a host PVC backing one guest volume.
type VolumeSpec struct {
	Name         string
	Bytes        int64
	Mode         corev1.PersistentVolumeMode
	StorageClass string // empty: the host's default class
	Annotations  map[string]string
	// FromSnapshot names a host VolumeSnapshot to restore the PVC from.
	FromSnapshot string
	// FromVolume names a host PVC of the namespace to clone the PVC from.
	// Longhorn clones only at the source's size, so Bytes is then the
	// source's size and an existing clone may have grown past it.
	FromVolume string
}

// VolumeMismatchError reports an existing host PVC whose spec differs from the
// request, which CSI calls ALREADY_EXISTS.
type VolumeMismatchError struct {
	Name, Why string
}

func (e *VolumeMismatchError) Error() string {
	return fmt.Sprintf("host PVC %s already exists with a different spec: %s", e.Name, e.Why)
}

// CreateVolume creates the host PVC, or returns the existing one when its spec
// matches: the provisioner retries CreateVolume after timeouts.
func (c *Client) CreateVolume(ctx context.Context, spec VolumeSpec) (*corev1.PersistentVolumeClaim, error) {
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{
			Name: spec.Name, Namespace: c.Namespace, Annotations: spec.Annotations,
			Labels: map[string]string{VolumeLabel: VolumeLabelValue},
		},
		Spec: corev1.PersistentVolumeClaimSpec{
			// ReadWriteMany on the host lets the guest's VM live-migrate.
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany},
			VolumeMode:  &spec.Mode,
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{
				corev1.ResourceStorage: *resource.NewQuantity(spec.Bytes, resource.BinarySI),
			}},
		},
	}
	if spec.StorageClass != "" {
		pvc.Spec.StorageClassName = &spec.StorageClass
	}
	if spec.FromSnapshot != "" {
		pvc.Spec.DataSource = &corev1.TypedLocalObjectReference{
			APIGroup: &snapshotResource.Group, Kind: "VolumeSnapshot", Name: spec.FromSnapshot,
		}
	}
	if spec.FromVolume != "" {
		pvc.Spec.DataSource = &corev1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: spec.FromVolume}
	}
	pvcs := c.Kube.CoreV1().PersistentVolumeClaims(c.Namespace)
	// The provisioner calls again for a volume whose first call timed out
	// (waiting for the bind): read first, so a repeat is answered from what
	// exists instead of a create the API server refuses with 409.
	existing, err := pvcs.Get(ctx, spec.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		created, cerr := pvcs.Create(ctx, pvc, metav1.CreateOptions{})
		if cerr == nil {
			return created, nil
		}
		if !apierrors.IsAlreadyExists(cerr) {
			return nil, cerr
		}
		// Created meanwhile by a concurrent call: judge that one.
		existing, err = pvcs.Get(ctx, spec.Name, metav1.GetOptions{})
	}
	if err != nil {
		return nil, err
	}
	if why := mismatch(existing, spec); why != "" {
		return nil, &VolumeMismatchError{Name: spec.Name, Why: why}
	}
	return existing, nil
}

func mismatch(pvc *corev1.PersistentVolumeClaim, spec VolumeSpec) string {
	// A clone is created at its source's size and grown afterwards.
	if got := pvc.Spec.Resources.Requests[corev1.ResourceStorage]; got.Value() != spec.Bytes && (spec.FromVolume == "" || got.Value() < spec.Bytes) {
		return fmt.Sprintf("size %d, requested %d", got.Value(), spec.Bytes)
	}
	mode := corev1.PersistentVolumeFilesystem
	if pvc.Spec.VolumeMode != nil {
		mode = *pvc.Spec.VolumeMode
	}
	if mode != spec.Mode {
		return fmt.Sprintf("volume mode %s, requested %s", mode, spec.Mode)
	}
	if spec.StorageClass != "" && (pvc.Spec.StorageClassName == nil || *pvc.Spec.StorageClassName != spec.StorageClass) {
		return fmt.Sprintf("storage class %v, requested %s", deref(pvc.Spec.StorageClassName), spec.StorageClass)
	}
	if want := dataSourceOf(spec); !sameDataSource(pvc.Spec.DataSource, want) {
		return fmt.Sprintf("data source %s, requested %s", describeSource(pvc.Spec.DataSource), describeSource(want))
	}
	return ""
}

// dataSourceOf is the kind and name of the data source spec asks for (nil:
// an empty volume).
func dataSourceOf(spec VolumeSpec) *corev1.TypedLocalObjectReference {
	switch {
	case spec.FromSnapshot != "":
		return &corev1.TypedLocalObjectReference{Kind: "VolumeSnapshot", Name: spec.FromSnapshot}
	case spec.FromVolume != "":
		return &corev1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: spec.FromVolume}
	}
	return nil
}

func sameDataSource(have, want *corev1.TypedLocalObjectReference) bool {
	if have == nil || want == nil {
		return have == want
	}
	return have.Kind == want.Kind && have.Name == want.Name
}

func describeSource(src *corev1.TypedLocalObjectReference) string {
	if src == nil {
		return "none"
	}
	return src.Kind + " " + src.Name
}

func deref(s *string) string {
	if s == nil {
		return "<default>"
	}
	return *s
}

// GetVolume returns the host PVC of a volume.
func (c *Client) GetVolume(ctx context.Context, name string) (*corev1.PersistentVolumeClaim, error) {
	return c.Kube.CoreV1().PersistentVolumeClaims(c.Namespace).Get(ctx, name, metav1.GetOptions{})
}

// ListVolumes returns the host PVCs CreateVolume made that are not being
// deleted. Volumes an upstream driver created carry no label and are not
// listed here; the caller adds whatever is hot-plugged.
func (c *Client) ListVolumes(ctx context.Context) ([]corev1.PersistentVolumeClaim, error) {
	list, err := c.Kube.CoreV1().PersistentVolumeClaims(c.Namespace).List(ctx, metav1.ListOptions{
		LabelSelector: VolumeLabel + "=" + VolumeLabelValue,
	})
	if err != nil {
		return nil, err
	}
	out := list.Items[:0]
	for _, p := range list.Items {
		if p.DeletionTimestamp == nil {
			out = append(out, p)
		}
	}
	return out, nil
}

// DeleteVolume deletes the host PVC; a missing one is not an error.
func (c *Client) DeleteVolume(ctx context.Context, name string) error {
	err := c.Kube.CoreV1().PersistentVolumeClaims(c.Namespace).Delete(ctx, name, metav1.DeleteOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

// StorageClassUsable reports whether a host storage class exists. A guest
// without permission to read classes gets the benefit of the doubt, as
// upstream: the PVC creation will tell.
func (c *Client) StorageClassUsable(ctx context.Context, name string) (bool, error) {
	_, err := c.Kube.StorageV1().StorageClasses().Get(ctx, name, metav1.GetOptions{})
	switch {
	case err == nil, apierrors.IsForbidden(err):
		return true, nil
	case apierrors.IsNotFound(err):
		return false, nil
	default:
		return false, err
	}
}

// WaitBound watches a host PVC until it is Bound or ctx ends, and returns its
// last state. Longhorn binds at once; a class that waits for a consumer never
// binds here, so callers bound ctx and carry on with what they have.
func (c *Client) WaitBound(ctx context.Context, name string) (*corev1.PersistentVolumeClaim, error) {
	return c.waitVolume(ctx, name, func(p *corev1.PersistentVolumeClaim) bool { return p.Status.Phase == corev1.ClaimBound })
}

// ExpandVolume raises the host PVC's storage request to bytes (never lowers
// it) and waits until the host reports the new capacity or ctx ends; it
// returns the claim's last state either way.
func (c *Client) ExpandVolume(ctx context.Context, name string, bytes int64) (*corev1.PersistentVolumeClaim, error) {
	pvcs := c.Kube.CoreV1().PersistentVolumeClaims(c.Namespace)
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		pvc, err := pvcs.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if req := pvc.Spec.Resources.Requests[corev1.ResourceStorage]; req.Value() >= bytes {
			return nil
		}
		if pvc.Spec.Resources.Requests == nil {
			pvc.Spec.Resources.Requests = corev1.ResourceList{}
		}
		pvc.Spec.Resources.Requests[corev1.ResourceStorage] = *resource.NewQuantity(bytes, resource.BinarySI)
		_, err = pvcs.Update(ctx, pvc, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return nil, err
	}
	return c.waitVolume(ctx, name, func(p *corev1.PersistentVolumeClaim) bool {
		got := p.Status.Capacity[corev1.ResourceStorage]
		return got.Value() >= bytes
	})
}

// waitVolume watches a host PVC until done says so or ctx ends, and returns
// its last state.
func (c *Client) waitVolume(ctx context.Context, name string, done func(*corev1.PersistentVolumeClaim) bool) (*corev1.PersistentVolumeClaim, error) {
	pvcs := c.Kube.CoreV1().PersistentVolumeClaims(c.Namespace)
	pvc, err := pvcs.Get(ctx, name, metav1.GetOptions{})
	if err != nil || done(pvc) {
		return pvc, err
	}
	w, err := pvcs.Watch(ctx, metav1.ListOptions{
		FieldSelector:   fields.OneTermEqualSelector("metadata.name", name).String(),
		ResourceVersion: pvc.ResourceVersion,
	})
	if err != nil {
		return pvc, err
	}
	defer w.Stop()
	for {
		select {
		case <-ctx.Done():
			return pvc, ctx.Err()
		case ev, ok := <-w.ResultChan():
			if !ok {
				return pvc, fmt.Errorf("watch of host PVC %s ended", name)
			}
			if p, isPVC := ev.Object.(*corev1.PersistentVolumeClaim); isPVC {
				pvc = p
				if done(pvc) {
					return pvc, nil
				}
			}
		}
	}
}
